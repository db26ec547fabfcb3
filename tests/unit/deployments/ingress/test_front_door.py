"""The front door's split: the fleet's routes answered by its app, any other path handed to Serve's proxy (a real
HTTP server on loopback here) unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, Request

from deployments.ingress.front_door import HOP_BY_HOP, ForwardUnmatched, FrontDoor, bind, mounted_at


def fleet_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": ["base"]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"echo": (await request.body()).decode()}

    return app


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


class Upstream:
    """Serve's proxy (or another application's door), as the door sees it: a real HTTP server on loopback that records
    what reached it and answers with a gzip body, streamed in pieces."""

    def __init__(self):
        self.seen: list[Seen] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(request.method, request.raw_path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        reply = web.StreamResponse(status=201, headers={"content-encoding": "gzip", "x-upstream": "serve"})
        await reply.prepare(request)
        packed = gzip.compress(b"from the proxy: " + body)
        for at in range(0, len(packed), 1000):
            await reply.write(packed[at : at + 1000])
        await reply.write_eof()
        return reply

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            yield self.url
        finally:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def door(forward: ForwardUnmatched) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the fleet's door, served in this process; the door's own connections closed after."""
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=forward), base_url="http://fleet") as client:
            yield client
    finally:
        await forward.close()


def test_the_fleets_routes_never_reach_the_proxy():
    upstream = Upstream()

    async def main():
        async with upstream.serving() as url, door(ForwardUnmatched(fleet_app(), url)) as client:
            assert (await client.get("/v1/models")).json() == {"data": ["base"]}
            assert (await client.post("/v1/completions", content=b"{}")).json() == {"echo": "{}"}
            # A fleet path asked with a wrong method is the fleet's 405, not someone else's route.
            assert (await client.delete("/v1/models")).status_code == 405

    asyncio.run(main())
    assert upstream.seen == []


def test_other_paths_go_to_the_proxy_whole_without_connection_headers():
    upstream = Upstream()
    body = bytes(range(256)) * 300  # more than one ASGI message
    packed = gzip.compress(body)

    async def main():
        async with upstream.serving() as url, door(ForwardUnmatched(fleet_app(), url)) as client:
            headers = {
                "authorization": "Bearer tml-key",
                "content-encoding": "gzip",
                "te": "trailers",
                "upgrade": "h2c",
            }
            reply = await client.post("/api/v1/forward_backward?wait=1&x=%2F", content=packed, headers=headers)
            return reply, url

    reply, url = asyncio.run(main())
    assert reply.status_code == 201
    assert reply.headers["x-upstream"] == "serve" and "connection" not in reply.headers
    # As the upstream sent it, compressed: the client inflates it.
    assert reply.headers["content-encoding"] == "gzip" and reply.content == b"from the proxy: " + body
    (seen,) = upstream.seen
    assert seen.method == "POST" and seen.raw_path == "/api/v1/forward_backward?wait=1&x=%2F" and seen.body == body
    # Sent on as it came, compressed: the upstream inflates it.
    assert seen.headers["authorization"] == "Bearer tml-key" and seen.headers["content-encoding"] == "gzip"
    assert int(seen.headers["content-length"]) == len(packed)
    assert "te" not in seen.headers and "upgrade" not in seen.headers
    assert seen.headers["host"] == url.removeprefix("http://")
    # The client's headers, less the connection's: none of the door's own added, none replaced.
    sent = {k.lower(): v for k, v in reply.request.headers.items() if k.lower().encode() not in HOP_BY_HOP}
    assert {k: v for k, v in seen.headers.items() if k != "host"} == sent


def test_a_proxy_that_does_not_answer_is_a_502_with_a_reason():
    async def main():
        async with Upstream().serving() as url:
            pass  # gone: nothing listens there now
        async with door(ForwardUnmatched(fleet_app(), url)) as client:
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
    proxy, tinker = Upstream(), Upstream()
    clock = [1000.0]
    monkeypatch.setattr("deployments.ingress.front_door.time.monotonic", lambda: clock[0])

    async def main():
        async with proxy.serving() as proxy_url, tinker.serving() as tinker_url:
            forward = ForwardUnmatched(fleet_app(), proxy_url)
            forward.open_door("/api", tinker_url, ttl_s=30)
            async with door(forward) as client:
                await client.get("/api/v1/healthz")
                await client.get("/apis")  # another prefix: not the door's
                assert (await client.get("/v1/models")).json() == {"data": ["base"]}  # the fleet's own, as ever
                clock[0] += 31  # not announced again: Serve's proxy routes it, slower
                await client.get("/api/v1/healthz")

    asyncio.run(main())
    assert [s.raw_path for s in tinker.seen] == ["/api/v1/healthz"]
    assert [s.raw_path for s in proxy.seen] == ["/apis", "/api/v1/healthz"]


def test_one_clients_cookies_never_go_with_anothers_request():
    """The door's one connection pool serves every client: a cookie the upstream sets for one is not kept."""
    upstream = Upstream()

    async def setter(request: web.Request) -> web.Response:
        upstream.seen.append(Seen(request.method, request.raw_path, dict(request.headers), b""))
        reply = web.Response(text="{}")
        reply.set_cookie("session", "alice")
        return reply

    upstream.handle = setter

    async def main():
        async with upstream.serving() as url:
            by_name = url.replace("127.0.0.1", "localhost")  # a host name: a cookie jar would keep its cookies
            async with door(ForwardUnmatched(fleet_app(), by_name)) as client:
                await client.get("/api/v1/login")
                client.cookies.clear()  # bob's client: no cookie of its own
                await client.get("/api/v1/whoami")

    asyncio.run(main())
    assert [("cookie" in {k.lower() for k in s.headers}) for s in upstream.seen] == [False, False]


def test_an_application_mounted_at_its_route_prefix_sees_paths_as_under_serves_proxy():
    """The Tinker service's door gets the whole path (/api/v1/...), as Serve's proxy hands it, its routes relative."""

    async def main():
        app = mounted_at(fleet_app(), "/api")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tinker") as client:
            return (await client.get("/api/v1/models")).json()

    assert asyncio.run(main()) == {"data": ["base"]}
