"""The fleet's HTTP API (`deployments.api`, `deployments.api_schema`) over a fake backend: request parsing,
OpenAI shapes, auth, all-or-nothing admin calls."""

import base64

import pytest
from fastapi.testclient import TestClient

from deployments.api import ApiSettings, make_app
from deployments.protocol import BadRequest, Generated, GenerateRequest, ModelNotFound, SampledChoice

TOKEN = "s3cret-token-value"
BASE = "/models/tiny"


class FakeBackend:
    """Two replicas that echo, with switches for the failures the API must handle."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail_load_on: set[int] = set()
        self.adapters = {0: set(), 1: set()}

    async def generate(self, request: GenerateRequest) -> Generated:
        self.calls.append(("generate", request))
        if request.model not in (BASE, "policy-v1"):
            raise ModelNotFound(f"model {request.model!r} is not loaded")
        sampling = request.sampling
        top = [{5: -0.5, 9: -2.0}, {6: -1.0, 9: -2.5}, {7: -1.5, 9: -3.0}] if sampling.logprobs else None
        choices = [
            SampledChoice(
                index=i,
                token_ids=[5, 6, 7][: sampling.max_tokens],
                logprobs=[-0.5, -1.0, -1.5][: sampling.max_tokens],
                top_logprobs=top[: sampling.max_tokens] if top else None,
                finish_reason="length",
                stop_reason=None,
            )
            for i in range(sampling.n)
        ]
        return Generated("r0", choices)

    async def broadcast(self, method, *args):
        self.calls.append((method, *args))
        out = []
        for replica in (0, 1):
            if method == "load_adapter":
                if replica in self.fail_load_on:
                    out.append(BadRequest("lora_path is outside the bucket"))
                    continue
                self.adapters[replica].add(args[0])
                out.append({"replica": f"r{replica}", "loaded": True})
            elif method == "undo_load":
                self.adapters[replica].discard(args[0])
                out.append({"replica": f"r{replica}", "unloaded": True})
            elif method == "unload_adapter":
                out.append({"replica": f"r{replica}", "unloaded": args[0] in self.adapters[replica]})
                self.adapters[replica].discard(args[0])
            elif method == "list_adapters":
                out.append(
                    {
                        "replica": f"r{replica}",
                        "adapters": [{"name": a, "source": "file:///b", "inflight": 0} for a in self.adapters[replica]],
                    }
                )
            elif method in ("pause", "resume", "ping"):
                out.append({"replica": f"r{replica}"})
            elif method == "reset_prefix_cache":
                out.append({"replica": f"r{replica}", "success": True})
        return out

    async def server_info(self):
        return {
            "lora_config": {"max_lora_rank": 8, "max_loras": 4},
            "parallel_config": {"data_parallel_size": 1},
            "model_config": {"dtype": "torch.float32"},
        }

    def router_stats(self):
        return {"router": "PrefixHashRouter", "totals": {"routed": 0}}


def _settings(**overrides):
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    inverse = {i: c for c, i in vocab.items()}
    settings = dict(
        base_model=BASE,
        model_aliases=frozenset({"tiny"}),
        max_model_len=32,
        vocab_size=64,
        encode=lambda text: [vocab[c] for c in text],
        decode=lambda ids: "".join(inverse.get(i, "?") for i in ids),
        chat_ids=lambda messages, add: [vocab[c] for m in messages for c in m["content"]] + ([26] if add else []),
        admin_token=TOKEN,
        num_replicas=2,
    )
    settings.update(overrides)
    return ApiSettings(**settings)


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def client(backend):
    return TestClient(make_app(backend, _settings()))


def _basic(password, user="trl"):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_completion_with_token_ids_has_the_openai_shape(client, backend):
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0.7,
        "top_k": -1,
        "logprobs": 0,
        "return_token_ids": True,
        "seed": 7,
        "repetition_penalty": 1.0,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    choice = out["choices"][0]
    assert choice["token_ids"] == [5, 6, 7] and choice["prompt_token_ids"] == [1, 2, 3]
    assert choice["text"] == "fgh" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0, -1.5] and choice["logprobs"]["tokens"] == list("fgh")
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert r.headers["x-spotrl-replica"] == "r0"
    # The alias resolves to the base model's canonical name: the router hashes one namespace for both.
    _, request = backend.calls[-1]
    assert (request.prompt_ids, request.model) == ([1, 2, 3], BASE)
    sampling = request.sampling
    assert sampling.top_k == 0 and sampling.seed == 7 and sampling.logprobs == 0
    assert (sampling.n, sampling.max_tokens, sampling.temperature) == (2, 3, 0.7)


def test_text_prompts_are_tokenized_by_the_ingress(client, backend):
    r = client.post("/v1/completions", json={"model": BASE, "prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1].prompt_ids == [0, 1, 2]
    assert r.json()["choices"][0]["logprobs"] is None and r.json()["choices"][0]["token_ids"] is None


def test_a_batch_of_prompts_numbers_choices_per_prompt(client):
    r = client.post("/v1/completions", json={"model": BASE, "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 1})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": [1, 2]}, "model"),
        ({"model": BASE, "prompt": []}, "prompt: empty"),
        ({"model": BASE, "prompt": [1, 99]}, "outside the vocabulary"),
        ({"model": BASE, "prompt": [1, True]}, "prompt"),
        ({"model": BASE, "prompt": [1, 2], "max_tokens": 31}, "max_model_len"),
        ({"model": BASE, "prompt": [1] * 32}, "no room"),
        ({"model": BASE, "prompt": [1], "n": 0}, "n:"),
        ({"model": BASE, "prompt": [1], "temperature": -1}, "temperature"),
        ({"model": BASE, "prompt": [1], "stop": ["\n"]}, "stop_token_ids"),
        ({"model": BASE, "prompt": [1], "stream": True}, "stream"),
        ({"model": BASE, "prompt": [1], "echo": True}, "echo"),
    ],
)
def test_malformed_completions_get_400_with_a_reason(client, body, reason):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]


def test_bodies_that_are_not_json_objects_get_400(client):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "body" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"model": "policy-v9", "prompt": [1], "max_tokens": 1})
    assert r.status_code == 404 and "policy-v9" in r.json()["error"]["message"]


def test_chat_completion_uses_the_chat_template(client, backend):
    body = {
        "model": "policy-v1",
        "messages": [{"role": "user", "content": "ab"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "fg"}
    assert [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0]
    assert backend.calls[-1][1].prompt_ids == [0, 1, 26]  # template applied with the generation prompt
    r = client.post("/v1/chat/completions", json={"model": BASE, "messages": []})
    assert r.status_code == 400


def test_models_lists_base_then_adapters_with_max_model_len(client, backend):
    backend.adapters = {0: {"policy-v2", "policy-v10"}, 1: {"policy-v2"}}
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [BASE, "policy-v2", "policy-v10"]
    assert all(m["max_model_len"] == 32 for m in data)
    assert data[1]["replicas"] == 2 and data[2]["replicas"] == 1


def test_server_info_has_what_trl_reads(client):
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["lora_config"]["max_loras"] == 4 and info["parallel_config"]["data_parallel_size"] == 1
    assert client.get("/server_info", params={"config_format": "yaml"}).status_code == 400


def test_admin_calls_need_the_token_as_bearer_or_basic(client):
    body = {"lora_name": "policy-v1", "lora_path": "adapters/policy-v1"}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        _basic("wrong"),
        {"Authorization": "Token " + TOKEN},
        {"Authorization": "Basic !!notbase64"},
    ):
        r = client.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert TOKEN not in r.text
        assert "Basic" in r.headers["www-authenticate"]
    assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert (
        client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    )
    assert client.post("/v1/load_lora_adapter", json=body, headers=_basic(TOKEN)).status_code == 200
    # Inference stays open unless the config switch closes it.
    assert client.post("/v1/completions", json={"model": BASE, "prompt": [1], "max_tokens": 1}).status_code == 200


def test_protect_inference_puts_generation_behind_the_token(backend):
    client = TestClient(make_app(backend, _settings(protect_inference=True)))
    body = {"model": BASE, "prompt": [1], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=body, headers=_basic(TOKEN)).status_code == 200
    assert client.get("/health").status_code == 200  # liveness stays open for load balancers


def test_without_a_token_admin_calls_are_open(backend):
    client = TestClient(make_app(backend, _settings(admin_token=None)))
    assert client.post("/resume").status_code == 200


def test_malformed_admin_bodies_get_400_after_auth(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=auth).status_code == 400
    assert client.post("/v1/load_lora_adapter", content=b"nope", headers=auth).status_code == 400
    r = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "p", "load_inplace": True}, headers=auth
    )
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    assert client.post("/pause", params={"mode": "later"}, headers=auth).status_code == 400


def test_a_load_that_fails_anywhere_is_rolled_back_everywhere(client, backend):
    backend.fail_load_on = {1}
    body = {"lora_name": "policy-v1", "lora_path": "/etc/passwd"}
    r = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "outside the bucket" in r.json()["error"]["message"]
    load_id = [c for c in backend.calls if c[0] == "load_adapter"][-1][3]
    assert ("undo_load", "policy-v1", load_id) in backend.calls
    assert backend.adapters == {0: set(), 1: set()}


def test_unload_of_a_missing_name_is_not_an_error(client):
    r = client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "policy-v7"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 200 and r.json()["unloaded"] == 0


def test_top_logprobs_name_alternatives_by_their_text(client):
    body = {"model": BASE, "prompt": [1, 2], "max_tokens": 2, "logprobs": 2}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["f", "g"] and logprobs["text_offset"] == [0, 1]
    assert logprobs["top_logprobs"] == [{"f": -0.5, "j": -2.0}, {"g": -1.0, "j": -2.5}]
    chat = {"model": BASE, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    content = client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}).json()
    (first,) = content["choices"][0]["logprobs"]["content"]
    assert first["token"] == "f" and first["bytes"] == [ord("f")]
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("f", -0.5), ("j", -2.0)]


def test_logprob_tokens_are_decoded_once_per_token_id_or_not_at_all(backend):
    """Per-token strings cost a decode only when asked for, once per token id, and never as token ids."""
    decoded = []
    plain = _settings().decode

    def counting_decode(ids):
        decoded.append(list(ids))
        return plain(ids)

    client = TestClient(make_app(backend, _settings(decode=counting_decode)))
    body = {"model": BASE, "prompt": [1, 2], "n": 2, "max_tokens": 3, "logprobs": 0}
    r = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:5", "token_id:6", "token_id:7"] and logprobs["text_offset"] == [0, 10, 20]
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5]
    assert decoded == [[5, 6, 7]] * 2  # the two choices' texts, nothing per token
    decoded.clear()
    for _ in range(2):
        r = client.post("/v1/completions", json=body)
        assert r.json()["choices"][1]["logprobs"]["tokens"] == list("fgh")
    assert sorted(decoded) == sorted([[5, 6, 7]] * 4 + [[5], [6], [7]])  # each token id decoded once
    decoded.clear()
    client.post("/v1/completions", json={**body, "logprobs": None})
    assert decoded == [[5, 6, 7]] * 2  # no log-probs asked for: no per-token strings at all
    chat = {"model": BASE, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "logprobs": True}
    r = client.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True})
    (first,) = r.json()["choices"][0]["logprobs"]["content"]
    assert first["token"] == "token_id:5" and first["bytes"] == list(b"token_id:5")
