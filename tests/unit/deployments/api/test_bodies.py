"""Request bodies (`deployments.api.bodies`): vLLM's ranges, strict JSON, and how much one request may ask for;
nothing refused reaches an engine."""

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import BASE, FakeBackend, api_settings, request_limits


def test_bodies_that_are_not_json_objects_get_400(client):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "body" in r.json()["error"]["message"]


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
        {"stop": "\n"},
        {"stop_token_ids": [0, 63], "stop": ["x" * 1024] * 16},
    ):
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, (extra, r.text)
    sampling = backend.calls[-1][1].sampling
    assert sampling.stop_token_ids == [0, 63] and sampling.stop == ["x" * 1024] * 16
    assert backend.calls[-2][1].sampling.stop == ["\n"]  # one string is a list of one, as vLLM takes it


def test_prompts_completions_and_text_per_request_are_limited(backend):
    limits = request_limits(max_prompts_per_request=4, max_sequences_per_request=8, max_text_chars=10)
    client = TestClient(make_app(backend, api_settings(limits=limits)))
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
    # The first request's, nothing of the refused ones: its 4 like prompts as one call (`deployments.control.coalesce`).
    assert [g[1].sampling.n for g in generations] == [8]


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
    client = TestClient(make_app(FakeBackend(), api_settings()), raise_server_exceptions=False)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)


def test_surrogate_pairs_are_text_not_an_error(client):
    raw = f'{{"model": "{BASE}", "prompt": [1], "max_tokens": 1, "user": "\\ud83d\\ude00"}}'  # as json.dumps sends 😀
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
