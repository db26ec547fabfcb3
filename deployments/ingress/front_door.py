"""The fleet's front door: the ingress replica serves its HTTP API itself, at `fleet.host:fleet.port`.

Why not Serve's HTTP proxy: a request through it crosses two Python processes before any of the fleet's own code runs.
The proxy parses it and calls the ingress replica as a Ray actor; the replica then calls back into the proxy for the
body (`receive_asgi_messages`, with a `get_actor` lookup) and streams the reply back message by message. Measured on
`make serve`'s fleet (bench.request_shapes, issue 46), that path cost about 11 ms of CPU per request in the proxy and the
ingress, 80% of what a single-sample request cost the fleet, against about 2 ms served here. vLLM's own server pays
one parse per request; so does the fleet now, then one handle call to a replica, whose router still picks the replica
by prefix and adapter. Everything the fleet guarantees lives in the app, not in the door: auth, fair share, bounded
bodies, hand-back.

Serve's proxy still runs, on `fleet.proxy_port`, for what the fleet does not answer: the other Serve applications of the
cluster (the Tinker API under `/api`), and Serve's own paths (`/-/routes`). The door hands any path that none of the
fleet's routes matches to it (`ForwardUnmatched`), so one address serves everything, as before. Another application
may open a door of its own on loopback and announce it for its path prefix (`Ingress.open_door`, renewed while it
lives: the Tinker service does); its requests then skip Serve's proxy too, at the cost of one loopback hop.

The door binds in the background and tries again while the port is taken (a replica being replaced still holds it);
where it never opens (Serve's proxy itself on the port: a Serve config of an older release), the fleet is still
served by the proxy, slower, and the log says what to change.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
from multidict import CIMultiDict
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send
from yarl import URL

from deployments.api.callers import has_body

log = logging.getLogger("ray.serve")

BIND_RETRY_S = 0.5  # between two tries of a taken port
BIND_WARN_AFTER = 20  # tries (10 s) before the log says the port stays taken
# Headers that describe one connection, not the request: never passed on (RFC 9110, 7.6.1), nor the Host.
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization te trailer transfer-encoding upgrade host".split()
)
# What aiohttp would add to a request that lacks them: a forwarded request goes on with the client's headers alone.
AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


class ForwardUnmatched:
    """ASGI app: the fleet's app answers every path one of its routes matches (a wrong method included: its 405);
    any other path goes to the door announced for its prefix, else to Serve's proxy at `upstream`, streamed both ways,
    its reply passed back unchanged.

    The hop goes through aiohttp, not httpx: a Tinker RL step's hundreds of single-sample requests and their
    futures' polls, forwarded at once, cost httpx's connection pool seconds of the ingress's CPU (issue 46)."""

    def __init__(self, app, upstream: str):
        self._app = app
        self._routes = app.router.routes
        self._proxy = upstream.rstrip("/")
        self._doors: dict[str, tuple[str, float]] = {}  # path prefix -> (its app's door, open until)
        self._http: aiohttp.ClientSession | None = None  # made on the event loop that forwards, at its first request

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # every request in flight has its connection
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0),  # a Tinker future may be waited on for minutes
                auto_decompress=False,  # a compressed reply goes back as it came
                cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies are never sent with another's request
                trust_env=False,
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    def answers(self, scope: Scope) -> bool:
        """Whether the fleet's own app has a route for this request's path."""
        return any(route.matches(scope)[0] is not Match.NONE for route in self._routes)

    def open_door(self, prefix: str, url: str, ttl_s: float) -> None:
        """Paths under `prefix` go to `url` (another application's own door, on loopback) for the next `ttl_s`
        seconds, instead of Serve's proxy; announced again before then by the application while it lives."""
        url = url.rstrip("/")
        current = self._doors.get(prefix)
        if current is None or current[0] != url:
            log.info("front door: %s* goes to %s", prefix, url)
        self._doors[prefix] = (url, time.monotonic() + ttl_s)

    def upstream(self, path: str) -> str:
        """Where a path the fleet does not answer goes: the door announced for its prefix, if still open, else Serve's
        proxy (which routes every application, so a door that lapsed costs speed, not the request)."""
        now = time.monotonic()
        for prefix, (url, until) in self._doors.items():
            if until > now and (path == prefix or path.startswith(prefix.rstrip("/") + "/")):
                return url
        return self._proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.answers(scope):
            await self._app(scope, receive, send)
            return
        await self._forward(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        path = scope.get("raw_path") or scope["path"].encode()
        target = path + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        headers = CIMultiDict(
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP
        )
        upstream = self.upstream(scope["path"])
        url = URL(upstream + target.decode("latin-1"), encoded=True)  # the path as the client sent it, unquoted nothing
        try:
            response = await self._session().request(
                scope["method"],
                url,
                headers=headers,
                data=body() if has_body(Headers(scope=scope)) else None,
                allow_redirects=False,
                skip_auto_headers=AUTO_HEADERS,  # the client's headers go on as they came, none of aiohttp's added
            )
        except (TimeoutError, aiohttp.ClientError) as e:
            log.warning("front door: %s did not answer %s %s: %s", upstream, scope["method"], scope["path"], e)
            await _reply(
                send, 502, b'{"error": {"message": "nothing answered for this path behind the fleet", "code": 502}}'
            )
            return
        try:
            raw = [(k, v) for k, v in response.raw_headers if k.lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": response.status, "headers": raw})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException:
            response.close()  # its connection, mid-reply, is of no further use
            raise
        response.release()


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def mounted_at(app: ASGIApp, route_prefix: str) -> ASGIApp:
    """`app` as Serve's proxy calls an application of that route prefix: the path whole, the prefix its root path
    (which Starlette's routing takes off the path)."""

    async def mounted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": scope.get("root_path", "") + route_prefix}
        await app(scope, receive, send)

    return mounted


def reachable(host: str) -> str:
    """An address a client on this machine dials for a server bound to `host`: the wildcard ones read as loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def bind(host: str, port: int) -> socket.socket:
    """A listening socket at host:port (SO_REUSEADDR, as every server's); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


class FrontDoor:
    """uvicorn serving `app` at host:port (0: a free port) on the running event loop (a replica's), opened in the
    background.

    Serve runs the app's lifespan itself (the control layer's upkeep), so the door runs none. uvicorn installs signal
    handlers only on the main thread; Serve runs a replica's code on a thread of its own."""

    def __init__(self, app: ASGIApp, host: str, port: int, *, max_connections: int, route_prefix: str = ""):
        import uvicorn

        self.host, self.port = host, port
        config = uvicorn.Config(
            mounted_at(app, route_prefix) if route_prefix else app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            limit_concurrency=max_connections,  # beyond it a 503, as Serve's max_ongoing_requests gave
            timeout_keep_alive=30,
            server_header=False,
        )
        self._server = uvicorn.Server(config)
        self._socket: socket.socket | None = None
        self._bound = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._open_and_serve())

    @property
    def url(self) -> str | None:
        """Where the door listens (0.0.0.0 read as 127.0.0.1) once it is bound; None before. A bound socket queues
        connections until uvicorn accepts them, a moment later."""
        if self._socket is None:
            return None
        return f"http://{reachable(self.host)}:{self.port}"

    async def opened(self, wait_s: float | None) -> str | None:
        """`url`, waiting up to `wait_s` (None: as long as it takes) for the door to open; None if it has not."""
        try:
            await asyncio.wait_for(self._bound.wait(), timeout=wait_s)
        except TimeoutError:
            pass
        return self.url

    async def _open_and_serve(self) -> None:
        tries = 0
        while self._socket is None:
            try:
                self._socket = bind(self.host, self.port)
                self.port = self._socket.getsockname()[1]
            except OSError as e:
                if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    log.error("front door: cannot listen at %s:%d (%s); the fleet is served by Serve's proxy alone",
                              self.host, self.port, e)  # fmt: skip
                    return
                tries += 1
                if tries == BIND_WARN_AFTER:
                    log.warning(
                        "front door: %s:%d is still taken after %.0fs; trying on. Until it opens the fleet answers "
                        "only at Serve's proxy. If Serve's proxy itself listens there, give it fleet.proxy_port "
                        "(http_options.port in a Serve config)",
                        self.host,
                        self.port,
                        tries * BIND_RETRY_S,
                    )
                await asyncio.sleep(BIND_RETRY_S)
        self._bound.set()
        log.info("front door open at %s:%d", self.host, self.port)
        await self._server.serve(sockets=[self._socket])

    def stop(self) -> None:
        """Stop accepting and close (the replica is going); requests in flight end with the process."""
        self._server.should_exit = True  # uvicorn's loop reads it within a tenth of a second
        if self._socket is None and not self._loop.is_closed():  # still waiting for the port: stop waiting
            self._loop.call_soon_threadsafe(self._task.cancel)
