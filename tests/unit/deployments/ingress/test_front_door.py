"""The front door's split: the fleet's routes answered by its app, any other path handed to Serve's proxy unchanged."""

from __future__ import annotations

import asyncio
import errno
import socket

import httpx
import pytest
from fastapi import FastAPI, Request

from deployments.ingress.front_door import ForwardUnmatched, FrontDoor, bind, mounted_at


def fleet_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": ["base"]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"echo": (await request.body()).decode()}

    return app


class Upstream:
    """Serve's proxy, as the door sees it: records what reached it and answers with a streamed, compressed body."""

    def __init__(self, fail: bool = False):
        self.seen: list[httpx.Request] = []
        self.fail = fail

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.fail:
            raise httpx.ConnectError("connection refused", request=request)
        request.read()
        self.seen.append(request)
        return httpx.Response(
            201,
            headers={"content-encoding": "identity", "x-upstream": "serve", "connection": "close"},
            stream=httpx.ByteStream(b"from the proxy: " + request.content),
        )


def door(upstream: Upstream) -> httpx.AsyncClient:
    app = ForwardUnmatched(fleet_app(), "http://proxy:8001", transport=httpx.MockTransport(upstream))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fleet")


def test_the_fleets_routes_never_reach_the_proxy():
    upstream = Upstream()

    async def main():
        async with door(upstream) as client:
            assert (await client.get("/v1/models")).json() == {"data": ["base"]}
            assert (await client.post("/v1/completions", content=b"{}")).json() == {"echo": "{}"}
            # A fleet path asked with a wrong method is the fleet's 405, not someone else's route.
            assert (await client.delete("/v1/models")).status_code == 405

    asyncio.run(main())
    assert upstream.seen == []


def test_other_paths_go_to_the_proxy_whole_without_connection_headers():
    upstream = Upstream()

    async def main():
        async with door(upstream) as client:
            body = b"x" * 70_000  # more than one ASGI message
            headers = {
                "authorization": "Bearer tml-key",
                "content-encoding": "zstd",
                "te": "trailers",
                "upgrade": "h2c",
            }
            return await client.post("/api/v1/forward_backward?wait=1", content=body, headers=headers)

    reply = asyncio.run(main())
    assert reply.status_code == 201
    assert reply.headers["x-upstream"] == "serve" and "connection" not in reply.headers
    assert reply.content == b"from the proxy: " + b"x" * 70_000
    (seen,) = upstream.seen
    assert seen.method == "POST" and seen.url.raw_path == b"/api/v1/forward_backward?wait=1"
    assert seen.headers["authorization"] == "Bearer tml-key" and seen.headers["content-encoding"] == "zstd"
    assert "te" not in seen.headers and "upgrade" not in seen.headers and seen.headers["host"] == "proxy:8001"


def test_a_proxy_that_does_not_answer_is_a_502_with_a_reason():
    async def main():
        async with door(Upstream(fail=True)) as client:
            return await client.get("/-/routes")

    reply = asyncio.run(main())
    assert reply.status_code == 502
    assert "nothing answered for this path" in reply.json()["error"]["message"]


def test_the_door_waits_for_a_taken_port_and_opens_once_it_is_free(monkeypatch):
    monkeypatch.setattr("deployments.ingress.front_door.BIND_RETRY_S", 0.05)
    taken = bind("127.0.0.1", 0)
    port = taken.getsockname()[1]

    async def main():
        front = FrontDoor(fleet_app(), "127.0.0.1", port, max_connections=10)
        assert await front.opened(0.3) is None  # still taken: no URL handed out
        taken.close()
        url = await front.opened(5)
        assert url == f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            assert (await client.get("/v1/models")).json() == {"data": ["base"]}
        front.stop()
        await asyncio.sleep(0.3)

    asyncio.run(main())
    with socket.socket() as probe:  # stopped: the port is free again
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_bind_says_when_the_port_is_taken():
    taken = bind("127.0.0.1", 0)
    with pytest.raises(OSError) as raised:
        bind("127.0.0.1", taken.getsockname()[1])
    assert raised.value.errno == errno.EADDRINUSE
    taken.close()


def test_an_announced_door_takes_its_prefix_until_its_announcement_lapses(monkeypatch):
    upstream = Upstream()
    forward = ForwardUnmatched(fleet_app(), "http://proxy:8001", transport=httpx.MockTransport(upstream))
    clock = [1000.0]
    monkeypatch.setattr("deployments.ingress.front_door.time.monotonic", lambda: clock[0])

    async def main():
        forward.open_door("/api", "http://127.0.0.1:41000", ttl_s=30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=forward), base_url="http://fleet") as client:
            await client.get("/api/v1/healthz")
            await client.get("/apis")  # another prefix: not the door's
            assert (await client.get("/v1/models")).json() == {"data": ["base"]}  # the fleet's own, as ever
            clock[0] += 31  # not announced again: Serve's proxy routes it, slower
            await client.get("/api/v1/healthz")

    asyncio.run(main())
    assert [(r.url.host, r.url.path) for r in upstream.seen] == [
        ("127.0.0.1", "/api/v1/healthz"),
        ("proxy", "/apis"),
        ("proxy", "/api/v1/healthz"),
    ]


def test_an_application_mounted_at_its_route_prefix_sees_paths_as_under_serves_proxy():
    """The Tinker service's door gets the whole path (/api/v1/...), as Serve's proxy hands it, its routes relative."""

    async def main():
        app = mounted_at(fleet_app(), "/api")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tinker") as client:
            return (await client.get("/api/v1/models")).json()

    assert asyncio.run(main()) == {"data": ["base"]}
