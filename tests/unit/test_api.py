"""The fleet's HTTP API (`deployments.api`, `deployments.api_schema`) over a fake backend: request parsing,
OpenAI shapes, auth, all-or-nothing admin calls."""

import asyncio
import base64
import json
import time

import pytest
from fastapi.testclient import TestClient

from contracts.control import (
    AdapterInfo,
    AdapterListing,
    CacheReset,
    EngineReport,
    ListAdapters,
    LoadAdapter,
    Loaded,
    Pause,
    PauseState,
    Ping,
    Pong,
    ReportEngine,
    ResetPrefixCache,
    Resume,
    UndoLoad,
    UnloadAdapter,
    Unloaded,
)
from contracts.serving import BadRequest, Generated, GenerateRequest, ModelNotFound, SampledChoice
from deployments.api import ApiSettings, make_app

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
        if request.model not in (BASE, "policy-v1", "alice/policy-v1", "bob/policy-v1"):
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

    async def broadcast(self, command):
        self.calls.append((type(command).__name__, command))
        out = []
        for replica in (0, 1):
            rid = f"r{replica}"
            match command:
                case LoadAdapter(name=name):
                    if replica in self.fail_load_on:
                        out.append(BadRequest("lora_path is outside the bucket"))
                        continue
                    self.adapters[replica].add(name)
                    out.append(Loaded(rid, loaded=True))
                case UndoLoad(name=name):
                    self.adapters[replica].discard(name)
                    out.append(Unloaded(rid, unloaded=True))
                case UnloadAdapter(name=name):
                    out.append(Unloaded(rid, unloaded=name in self.adapters[replica]))
                    self.adapters[replica].discard(name)
                case ListAdapters():
                    infos = tuple(AdapterInfo(a, "file:///b", "sha", 0) for a in sorted(self.adapters[replica]))
                    out.append(AdapterListing(rid, infos))
                case Pause():
                    out.append(PauseState(rid, paused=True))
                case Resume():
                    out.append(PauseState(rid, paused=False))
                case Ping():
                    out.append(Pong(rid))
                case ResetPrefixCache():
                    out.append(CacheReset(rid, True))
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
        base_fingerprint=f"hub:{BASE}@main",  # what `model_fingerprint` says of a name that is no folder here
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


def test_an_episodes_turn_reaches_the_router_and_a_plain_request_says_none(client, backend):
    assert client.post("/v1/completions", json={"model": BASE, "prompt": [1, 2], "max_tokens": 1, "turn": 3}).is_success
    assert backend.calls[-1][1].turn == 3
    assert client.post("/v1/completions", json={"model": BASE, "prompt": [1, 2], "max_tokens": 1}).is_success
    assert backend.calls[-1][1].turn is None


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
        ({"model": BASE, "prompt": [1], "turn": 0}, "turn"),
        ({"model": BASE, "prompt": [1], "turn": "second"}, "turn"),
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
    json_auth = {**auth, "Content-Type": "application/json"}
    assert client.post("/v1/load_lora_adapter", content=b"nope", headers=json_auth).status_code == 400
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
    load_id = [c for c in backend.calls if c[0] == "LoadAdapter"][-1][1].load_id
    assert ("UndoLoad", UndoLoad("policy-v1", load_id)) in backend.calls
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


# ---- hardening: no request may crash, stall or open the fleet ---------------------------------------------


def _strict_json(text: str):
    """JSON as the RFC has it: NaN and Infinity are not numbers."""

    def refuse(name):
        raise ValueError(f"{name} in a response")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ('"seed": 9223372036854775808', "seed"),  # 2^63: kills vLLM's GPU model runner
        ('"seed": 18446744073709551615', "seed"),
        ('"seed": -9223372036854775809', "seed"),
        ('"temperature": NaN', "NaN"),
        ('"temperature": Infinity', "Infinity"),
        ('"presence_penalty": -Infinity', "Infinity"),
        ('"repetition_penalty": 1e400', "out of range"),
        ('"temperature": 2.5', "temperature"),
        ('"presence_penalty": 2.5', "presence_penalty"),
        ('"top_p": 0', "top_p"),
        ('"min_p": 1.5', "min_p"),
        ('"top_k": -2', "top_k"),
        ('"top_k": 9223372036854775808', "top_k"),
        ('"min_tokens": 3', "min_tokens: 3 exceeds max_tokens 2"),
        ('"temperature": 0, "n": 2', "greedily"),
        ('"stop_token_ids": [18446744073709551616]', "stop_token_ids: token id"),
        ('"stop_token_ids": [64]', "outside the vocabulary"),
        ('"logprobs": 21', "logprobs"),
    ],
)
def test_sampling_fields_are_bounded_as_vllm_bounds_them(client, backend, extra, reason):
    raw = f'{{"model": "{BASE}", "prompt": [1, 2], "max_tokens": 2, {extra}}}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    assert not [c for c in backend.calls if c[0] == "generate"]  # nothing reached an engine


def test_the_edges_of_vllms_ranges_are_accepted(client, backend):
    body = {"model": BASE, "prompt": [1, 2], "max_tokens": 2}
    for extra in (
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"seed": -1},
        {"temperature": 2.0, "presence_penalty": -2.0, "frequency_penalty": 2.0, "min_p": 1.0},
        {"temperature": 0.0, "n": 1, "min_tokens": 2},
        {"stop_token_ids": [0, 63]},
    ):
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert backend.calls[-1][1].sampling.stop_token_ids == [0, 63]


class NonFiniteBackend(FakeBackend):
    """An engine that reports -inf for filtered-out alternatives (as vLLM does) and NaN in its statistics."""

    async def generate(self, request):
        generated = await super().generate(request)
        for choice in generated.choices:
            choice.logprobs = [float("-inf"), float("nan"), -1.5][: len(choice.token_ids)]
            if choice.top_logprobs:
                choice.top_logprobs = [{5: -0.5, 9: float("-inf")} for _ in choice.token_ids]
        return generated

    async def broadcast(self, command):
        if isinstance(command, ReportEngine):
            counters = {"prefix_cache_hit_rate": float("nan"), "tokens": float("inf")}
            return [EngineReport("r0", 1, False, counters, (), 0, 0)]
        return await super().broadcast(command)


def test_no_response_holds_nan_or_infinity(backend):
    client = TestClient(make_app(NonFiniteBackend(), _settings()))
    body = {"model": BASE, "prompt": [1, 2], "max_tokens": 3, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    logprobs = _strict_json(r.text)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-9999.0, -9999.0, -1.5]  # vLLM's server floors -inf at -9999.0
    assert logprobs["top_logprobs"][0] == {"f": -0.5, "j": -9999.0}
    chat = {"model": BASE, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True}
    r = client.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
    content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in content] == [-9999.0, -9999.0]
    assert content[0]["top_logprobs"][1]["logprob"] == -9999.0
    stats = client.get("/engine/stats")
    assert stats.status_code == 200 and _strict_json(stats.text)["replicas"][0]["prefix_cache_hit_rate"] is None


def _asgi_post(app, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, int]:
    """POST straight through ASGI, the body in `chunks` (as a server streams it): (status, chunks read)."""
    read = 0
    status = None

    async def receive():
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(app(scope, receive, send))
    return status, read


def test_an_oversized_body_is_refused_before_it_is_read(backend):
    limit = 64 * 1024
    app = make_app(backend, _settings(limits=_limits(max_request_bytes=limit)))
    chunk = b" " * 16 * 1024
    json_type = {"content-type": "application/json"}
    # A declared length beyond the limit: refused before a byte is read.
    status, read = _asgi_post(app, "/v1/completions", {**json_type, "content-length": str(10**9)}, [chunk] * 1000)
    assert (status, read) == (413, 0)
    # Chunked (no length), or a length that lies: refused once the limit is crossed, the rest never read.
    for headers in (json_type, {**json_type, "content-length": "100"}):
        status, read = _asgi_post(app, "/v1/completions", headers, [chunk] * 1000)
        assert status == 413 and read == limit // len(chunk) + 1
    ok = json.dumps({"model": BASE, "prompt": [1], "max_tokens": 1}).encode()
    assert _asgi_post(app, "/v1/completions", json_type, [ok[:5], ok[5:]])[0] == 200
    r = TestClient(app).post("/v1/completions", content=b"x" * (limit + 1), headers=json_type)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def _limits(**overrides):
    from app.config import FleetSettings
    from deployments.api_schema import RequestLimits

    return RequestLimits.of(FleetSettings(**overrides))


def test_prompts_completions_and_text_per_request_are_limited(backend):
    limits = _limits(max_prompts_per_request=4, max_sequences_per_request=8, max_text_chars=10)
    client = TestClient(make_app(backend, _settings(limits=limits)))
    body = {"model": BASE, "max_tokens": 1}
    assert client.post("/v1/completions", json={**body, "prompt": [[1]] * 4, "n": 2}).status_code == 200
    for extra, reason in (
        ({"prompt": [[1]] * 5}, "5 prompts exceed the limit of 4"),
        ({"prompt": [[1]] * 3, "n": 3}, "9 completions exceed the limit of 8"),
        ({"prompt": ["abcdef", "abcde"]}, "11 characters of text exceed the limit of 10"),
    ):
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    chat = {**body, "messages": [{"role": "user", "content": "abcdefg"}]}  # role + content: 11 characters
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "characters of text" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**chat, "messages": [{"role": "u", "content": "ab"}], "n": 9})
    assert r.status_code == 400 and "completions exceed" in r.json()["error"]["message"]
    generations = [c for c in backend.calls if c[0] == "generate"]
    assert len(generations) == 4  # the first request's, nothing of the refused ones


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the interpreter goes
        b'{"model": "m", "prompt": [1], "user": ' + b"[" * 40 + b"]" * 40 + b"}",  # deeper than max_json_depth
        b'{"model": "\\ud800", "prompt": [1]}',  # a lone surrogate, echoed in the 404 and the reply
        b'{"model": "/models/tiny", "prompt": "ab\\udfff"}',  # ... or handed to the tokenizer
        b'{"model": "/models/tiny", "prompt": [1], "\\ud83d": 1}',  # ... or as a key
    ],
)
def test_deep_json_and_lone_surrogates_get_400(raw):
    client = TestClient(make_app(FakeBackend(), _settings()), raise_server_exceptions=False)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)


def test_surrogate_pairs_are_text_not_an_error(client):
    raw = f'{{"model": "{BASE}", "prompt": [1], "max_tokens": 1, "user": "\\ud83d\\ude00"}}'  # as json.dumps sends 😀
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_tokenizing_runs_off_the_event_loop(backend):
    """One slow prompt (a huge text, a slow chat template) must not stall other requests, /health included."""
    import httpx

    plain = _settings().encode

    def slow_encode(text):
        time.sleep(1.5)
        return plain(text)

    app = make_app(backend, _settings(encode=slow_encode))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as http:
            started = time.monotonic()
            slow = asyncio.create_task(
                http.post("/v1/completions", json={"model": BASE, "prompt": "abc", "max_tokens": 1})
            )
            await asyncio.sleep(0.2)  # the slow request is tokenizing now (or blocks the loop, sleep included)
            health = await http.get("/health")
            answered = time.monotonic() - started
            return (await slow).status_code, health.status_code, answered

    slow_status, health_status, answered = asyncio.run(run())
    assert (slow_status, health_status) == (200, 200)
    assert answered < 1.0, f"/health answered after {answered:.2f}s, behind a 1.5 s tokenization"


def test_admin_posts_must_declare_json(client):
    """A web page cannot send a CORS "simple" request that changes the fleet (text/plain, a form, or a body-less
    fetch, which always carries Origin); clients that are no browser send JSON, or nothing at all (TRL's /pause)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = '{"lora_name": "policy-v1", "lora_path": "adapters/policy-v1"}'
    for headers, content in (
        ({"content-type": "text/plain"}, body),
        ({"content-type": "application/x-www-form-urlencoded"}, "lora_name=policy-v1&lora_path=x"),
        ({"content-type": "multipart/form-data; boundary=x"}, "--x--"),
        ({}, body),  # a body with no type at all
    ):
        r = client.post("/v1/load_lora_adapter", content=content, headers={**auth, **headers})
        assert r.status_code == 415, (headers, r.text)
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/v1/unload_lora_adapter"):
        assert client.post(path, headers={**auth, "content-type": "text/plain"}).status_code == 415, path
        assert client.post(path, headers={**auth, "Origin": "http://evil.example"}).status_code == 415, path
    json_type = {**auth, "content-type": "application/json; charset=utf-8"}
    assert client.post("/v1/load_lora_adapter", content=body, headers=json_type).status_code == 200
    assert client.post("/pause", headers=auth).status_code == 200  # TRL: requests.post(url, params=...)
    assert client.post("/resume", headers=auth).status_code == 200
    # Without a token the content type is the only guard, and it holds.
    open_fleet = TestClient(make_app(FakeBackend(), _settings(admin_token=None)))
    assert open_fleet.post("/pause", headers={"content-type": "text/plain"}).status_code == 415


def test_a_failed_load_resumes_a_paused_fleet(client, backend):
    """TRL pauses, loads, and raises on a failed load before its /resume: the fleet must not stay paused."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/pause", headers=auth).status_code == 200
    backend.fail_load_on = {1}
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": "/etc"}, headers=auth)
    assert r.status_code == 400
    methods = [c[0] for c in backend.calls]
    assert methods[-3:] == ["LoadAdapter", "UndoLoad", "Resume"]
