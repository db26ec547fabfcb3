"""vLLM's `/inference/v1/generate` on the fleet (`deployments.api.inference_routes`) over a fake backend: what
verifiers' `TrainClient` sends (through `renderers.client.generate`) is taken, the reply is vLLM 0.32's own schema and
the one `renderers` parses, the session header reaches the router, and malformed requests get a 400 with a reason."""

import pytest

from tests.support.fake_fleet import BASE, TOKEN, bearer

# What `renderers.client.generate` posts (verifiers' TrainClient, sampling temperature 1 and max_tokens 3).
BODY = {
    "model": "policy-v1",
    "token_ids": [1, 2, 3],
    "sampling_params": {
        "temperature": 1.0,
        "max_tokens": 3,
        "stop_token_ids": [0],
        "logprobs": 1,
        "skip_special_tokens": False,
    },
}


def _post(client, body, session=None, headers=None):
    sent = {**bearer(TOKEN), **(headers or {})}
    if session is not None:
        sent["X-Session-ID"] = session
    return client.post("/inference/v1/generate", json=body, headers=sent)


def test_verifiers_request_gets_vllms_reply_which_renderers_parses(client, backend):
    from renderers.client import _parse_completion_logprobs
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse

    GenerateRequest.model_validate(BODY)  # what is sent here is a request vLLM takes
    r = _post(client, {**BODY, "return_token_ids": True}, session="trace-0a1b")
    assert r.status_code == 200, r.text
    reply = r.json()
    GenerateTokensResponse.model_validate(reply)  # vLLM 0.32's response schema
    choice = reply["choices"][0]
    assert choice["token_ids"] == [5, 6, 7] and choice["finish_reason"] == "length"
    assert _parse_completion_logprobs(choice, choice["token_ids"]) == [-0.5, -1.0, -1.5]  # as verifiers reads them
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [5, 6, 7]
    assert reply["prompt_token_ids"] == [1, 2, 3] and reply["usage"]["completion_tokens"] == 3
    assert r.headers["x-spotrl-replica"] == "r0"
    _, request = backend.calls[-1]
    assert (request.prompt_ids, request.model, request.session) == ([1, 2, 3], "policy-v1", "trace-0a1b")
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.logprobs, sampling.stop_token_ids) == (3, 1.0, 1, [0])


def test_defaults_the_base_model_all_the_room_and_no_session(client, backend):
    r = _post(client, {"token_ids": [1, 2], "sampling_params": {}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None and r.json()["prompt_token_ids"] is None
    _, request = backend.calls[-1]
    assert (request.model, request.session, request.sampling.max_tokens) == (BASE, None, 32 - 2)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "outside the vocabulary"),
        ({"token_ids": [1, 64]}, "outside the vocabulary"),
        ({"token_ids": "abc"}, "token_ids"),
        ({"sampling_params": None}, "sampling_params"),
        ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"sampling_params": {"max_tokens": 40}}, "max_model_len"),
        ({"sampling_params": {"stop": [""]}}, "stop: at most"),
        ({"sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
        ({"sampling_params": {"stop_token_ids": [99]}}, "stop_token_ids"),
        ({"stream": True}, "stream"),
        ({"content_parts": [{"type": "image_url"}]}, "content_parts"),
        ({"output_mode": "text"}, "output_mode"),
        ({"cache_salt": "salt"}, "cache_salt"),
        ({"model": "policy-v9"}, "not loaded"),
    ],
)
def test_malformed_requests_get_a_reason(client, change, reason):
    r = _post(client, {**BODY, **change})
    assert r.status_code in (400, 404), r.text
    assert reason in r.json()["error"]["message"]


@pytest.mark.parametrize("session", ["", "a b", "x" * 257])
def test_a_malformed_session_header_is_a_400(client, session):
    r = _post(client, BODY, session=session)
    assert r.status_code == 400 and "x-session-id" in r.json()["error"]["message"]


def test_a_run_reaches_its_own_adapters_only(fleet):
    from tests.support.fake_fleet import register

    _, client = fleet
    alice = register(client, "alice")
    assert _post(client, {**BODY, "model": "alice/policy-v1"}, headers=bearer(alice)).status_code == 200
    assert _post(client, {**BODY, "model": "bob/policy-v1"}, headers=bearer(alice)).status_code in (403, 404)
