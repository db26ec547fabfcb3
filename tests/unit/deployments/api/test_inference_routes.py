"""OpenAI's inference routes (`deployments.api.inference_routes`) over a fake backend: OpenAI's shapes, the
alias of the base model, batches, refusals, and tokenizing off the event loop."""

import asyncio
import time

import pytest

from deployments.api import make_app
from tests.support.fake_fleet import BASE, api_settings


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
        ({"model": BASE, "prompt": [1], "stop": [""]}, "stop: at most 16 strings of 1 to 1024 characters"),
        ({"model": BASE, "prompt": [1], "stop": ["x"] * 17}, "stop:"),
        ({"model": BASE, "prompt": [1], "stop": "x" * 1025}, "stop:"),
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


def test_tokenizing_runs_off_the_event_loop(backend):
    """One slow prompt (a huge text, a slow chat template) must not stall other requests, /health included."""
    import httpx

    plain = api_settings().encode

    def slow_encode(text):
        time.sleep(1.5)
        return plain(text)

    app = make_app(backend, api_settings(encode=slow_encode))

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


def test_prompt_logprobs_score_a_sequence_as_vllms_server_answers(client, backend):
    """What TRL's AsyncDistillationTrainer sends its teacher, and the shape of vLLM's answer that it reads."""
    body = {"model": BASE, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert backend.calls[-1][1].sampling.prompt_logprobs == 1  # reaches the engine under vLLM's name
    (choice,) = r.json()["choices"]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == 3  # nothing conditions the first token
    assert scored[1] == {
        "2": {"logprob": -0.25, "rank": 1, "decoded_token": "c"},
        "9": {"logprob": -9999.0, "rank": 2, "decoded_token": "j"},  # -inf floored, as vLLM floors it
    }
    assert scored[2]["3"]["logprob"] == -0.5
    as_ids = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    assert as_ids["choices"][0]["prompt_logprobs"][1]["2"]["decoded_token"] == "token_id:2"
    plain = client.post("/v1/completions", json={"model": BASE, "prompt": [1, 2], "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_a_sample_that_fills_the_context_is_scored_whole_but_never_generated_past_it(client, backend):
    """A teacher scores a sample of exactly max_model_len tokens (a multi-turn episode cut by its token budget): its
    one sampled token lies in the engines' room past the context. A generation may not use that room."""
    full = [1] * 32  # the fake fleet's max_model_len
    scoring = {"model": BASE, "prompt": full, "max_tokens": 1, "prompt_logprobs": 0}
    r = client.post("/v1/completions", json=scoring)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["prompt_logprobs"]) == 32 and backend.calls[-1][1].sampling.max_tokens == 1
    for refused in ({**scoring, "max_tokens": 2}, {**scoring, "prompt": [1] * 33}, {"model": BASE, "prompt": full}):
        r = client.post("/v1/completions", json=refused)
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text


def test_a_scoring_request_is_bounded_like_every_other():
    from fastapi.testclient import TestClient

    from core.config import FleetSettings
    from deployments.api.bodies import RequestLimits
    from tests.support.fake_fleet import FakeBackend

    limits = RequestLimits.of(FleetSettings(max_prompt_logprobs_per_request=20))
    client = TestClient(make_app(FakeBackend(), api_settings(limits=limits)))
    # 2 prompts of 4 tokens x (1 + 1) log-probs x n=1 = 16: within the limit; n=2 makes 32.
    body = {"model": BASE, "prompt": [[1, 2, 3, 4], [5, 6, 7, 8]], "max_tokens": 1, "prompt_logprobs": 1}
    assert client.post("/v1/completions", json=body).is_success
    r = client.post("/v1/completions", json={**body, "n": 2})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**body, "prompt_logprobs": 21})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]  # vLLM's max_logprobs


def test_a_teacher_deployment_is_everyones_and_tokenize_answers_the_fleets_ids():
    from fastapi.testclient import TestClient

    from tests.support.fake_fleet import TEACHER, FakeBackend, bearer, register

    backend = FakeBackend()
    settings = api_settings(deployed_models=frozenset({TEACHER}), max_loras=7, max_staleness=1)
    client = TestClient(make_app(backend, settings))
    alice = bearer(register(client, "alice"))
    body = {"model": TEACHER, "prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 0}
    r = client.post("/v1/completions", json=body, headers=alice)
    assert r.status_code == 200 and backend.calls[-1][1].model == TEACHER  # routed by its name to its replicas
    assert client.post("/v1/completions", json={**body, "model": "bob/policy-v1"}, headers=alice).status_code == 403
    listed = [m["id"] for m in client.get("/v1/models", headers=alice).json()["data"]]
    assert listed[:2] == [BASE, TEACHER]
    r = client.post("/tokenize", json={"model": TEACHER, "prompt": "abc"}, headers=alice)
    assert r.json() == {"count": 3, "max_model_len": 32, "tokens": [0, 1, 2], "token_strs": None}
