"""FleetClient (`app.fleet_client`) against the fleet's API over fake_fleet's backend: parsing, errors, retries. The
sync calls reach the app in-process; the async ones (aiohttp's, which take no in-process transport) a server of it on
loopback."""

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from app.fleet_client import FleetClient, FleetError
from contracts.retry import Backoff
from deployments.api import make_app
from tests.support.fake_fleet import BASE, TOKEN, FakeBackend, api_settings
from tests.support.fleet_helpers import free_port
from tests.support.served_app import answering, served


def _client(backend, token=TOKEN, **kwargs):
    """A FleetClient whose requests are served by the ASGI app, counting them."""
    app = TestClient(make_app(backend, api_settings()), raise_server_exceptions=False)
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        r = app.request(
            request.method,
            request.url.path,
            params=request.url.params,
            content=request.content,
            headers=dict(request.headers),
        )
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    client = FleetClient("http://fleet.test", token=token, transport=httpx.MockTransport(handler), **kwargs)
    return client, seen


def test_completions_come_back_as_choices():
    client, seen = _client(FakeBackend())
    choices = client.completions([1, 2, 3], BASE, n=2, max_tokens=2, temperature=1.0)
    assert [c.index for c in choices] == [0, 1]
    assert choices[0].token_ids == [5, 6] and choices[0].logprobs == [-0.5, -1.0]
    assert choices[0].text == "fg" and choices[0].finish_reason == "length"
    body = seen[-1].read()
    assert b'"return_token_ids":true' in body.replace(b" ", b"") and b'"logprobs":0' in body.replace(b" ", b"")


def test_admin_calls_send_the_token_and_errors_carry_the_status():
    backend = FakeBackend()
    client, seen = _client(backend)
    assert client.load_adapter("policy-v1", "adapters/policy-v1")["replicas"] == 2
    assert seen[-1].headers["authorization"] == f"Bearer {TOKEN}"
    anonymous, _ = _client(backend, token=None)
    with pytest.raises(FleetError) as denied:
        anonymous.pause()
    assert denied.value.status == 401 and TOKEN not in str(denied.value)
    with pytest.raises(FleetError) as missing:
        client.completions([1], "policy-v9", max_tokens=1)
    assert missing.value.status == 404
    assert TOKEN not in repr(client)


def test_no_live_replica_is_retried_then_reported():
    backend = FakeBackend()

    async def nobody(command):
        return []

    backend.broadcast = nobody
    client, seen = _client(backend, backoff=Backoff(attempts=3, first_s=0.0))
    with pytest.raises(FleetError) as unavailable:
        client.health()
    assert unavailable.value.status == 503 and len(seen) == 3 and client.retries_done == 2


def test_an_unreachable_fleet_is_a_fleet_error_without_status():
    client = FleetClient(f"http://127.0.0.1:{free_port()}", backoff=Backoff(attempts=2, first_s=0.0), timeout_s=5)
    with pytest.raises(FleetError) as down:
        client.models()
    assert down.value.status is None and "ConnectError" in str(down.value)


def test_async_calls_send_the_token_come_back_as_choices_and_errors_carry_the_status():
    backend = FakeBackend()
    with served(make_app(backend, api_settings())) as url:
        client = FleetClient(url, token=TOKEN)

        async def calls():
            try:
                choices = await client.acompletions([1, 2, 3], BASE, n=2, max_tokens=2, temperature=1.0)
                scored = await client.aprompt_logprobs([[1, 2, 3]], BASE)
                with pytest.raises(FleetError) as missing:
                    await client.acompletions([1], "policy-v9", max_tokens=1)
                anonymous = FleetClient(url, token=None)
                with pytest.raises(FleetError) as denied:
                    await anonymous.acut(["policy-v1"])
                await anonymous.aclose()
                return choices, scored, missing.value, denied.value
            finally:
                await client.aclose()

        choices, scored, missing, denied = asyncio.run(calls())
    assert [c.index for c in choices] == [0, 1] and choices[0].token_ids == [5, 6] and choices[0].text == "fg"
    assert len(scored) == 1 and scored[0][0] is None
    assert missing.status == 404 and "policy-v9" in str(missing)
    assert denied.status == 401 and TOKEN not in str(denied)


def test_async_calls_retry_what_the_fleet_could_not_answer_and_not_a_bad_request():
    answers = iter(
        [(503, {"error": {"message": "no replica"}}), (200, {"choices": []}), (400, {"error": {"message": "bad n"}})]
    )
    with answering(lambda path, body: next(answers)) as url:
        client = FleetClient(url, backoff=Backoff(attempts=3, first_s=0.0))

        async def calls():
            try:
                assert await client.acompletions([1], BASE) == []  # the 503 retried
                with pytest.raises(FleetError) as bad:
                    await client.acompletions([1], BASE)
                return bad.value
            finally:
                await client.aclose()

        bad = asyncio.run(calls())
    assert bad.status == 400 and "bad n" in str(bad) and client.retries_done == 1


def test_an_unreachable_fleet_is_an_async_fleet_error_without_status_too():
    client = FleetClient(f"http://127.0.0.1:{free_port()}", backoff=Backoff(attempts=2, first_s=0.0), timeout_s=5)
    with pytest.raises(FleetError) as down:
        asyncio.run(client.acompletions([1], BASE))
    assert down.value.status is None and client.retries_done == 1


def test_a_client_used_from_a_second_event_loop_makes_a_session_of_that_loop():
    """A session serves the loop it was made on alone: a caller that runs `asyncio.run` twice (an evaluation after
    another) gets a working client, not a closed loop's session."""
    with served(make_app(FakeBackend(), api_settings())) as url:
        client = FleetClient(url, token=TOKEN)
        first = asyncio.run(client.acompletions([1, 2], BASE, max_tokens=2))
        second = asyncio.run(client.acompletions([1, 2], BASE, max_tokens=2))
    assert len(first) == len(second) == 1
