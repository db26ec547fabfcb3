"""The API's replies (`deployments.api.replies`): log-prob listings named by text or by id, decoded once per
token, and never NaN or infinity, whatever the engine reports."""

import json

from fastapi.testclient import TestClient

from contracts.control import EngineReport, ReplicaTables, ReportEngine
from deployments.api import make_app
from tests.support.fake_fleet import BASE, FakeBackend, api_settings


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
    plain = api_settings().decode

    def counting_decode(ids):
        decoded.append(list(ids))
        return plain(ids)

    client = TestClient(make_app(backend, api_settings(decode=counting_decode)))
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


def _strict_json(text: str):
    """JSON as the RFC has it: NaN and Infinity are not numbers."""

    def refuse(name):
        raise ValueError(f"{name} in a response")

    return json.loads(text, parse_constant=refuse)


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
            return [EngineReport("r0", 1, False, counters, (), 0, 0, ReplicaTables(0, 0, 0, 1, 0, 0, 0, 0))]
        return await super().broadcast(command)


def test_no_response_holds_nan_or_infinity(backend):
    client = TestClient(make_app(NonFiniteBackend(), api_settings()))
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


def test_a_choice_a_stop_string_ended_keeps_its_tokens_and_its_text_stops_before_the_string():
    from contracts.serving import SampledChoice
    from deployments.api.replies import choice_text

    def decode(ids):
        return "".join({1: "ab", 2: "c\n", 3: "\nd"}[i] for i in ids)

    stopped = SampledChoice(0, [1, 2, 3], None, None, "stop", "\n")
    assert choice_text(stopped, decode) == "abc"  # vLLM's text: up to the stop string, whatever the token held after it
    by_token = SampledChoice(0, [1, 2], None, None, "stop", 2)  # a stop token id: the text is the tokens'
    assert choice_text(by_token, decode) == "abc\n"
    assert choice_text(SampledChoice(0, [1, 3], None, None, "length", None), decode) == "ab\nd"
