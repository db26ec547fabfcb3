"""An ASGI app served by uvicorn on 127.0.0.1 in a thread, for tests of clients that must talk over a real socket
(aiohttp takes no in-process transport: the fleet client's async calls, the Tinker service's fleet calls)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.fleet_helpers import free_port

# (path, JSON body or None) -> (status, JSON answer)
Answer = Callable[[str, dict | None], tuple[int, dict]]


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """`app` served at a free loopback port until the block ends; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def answering(answer: Answer) -> contextlib.AbstractContextManager[str]:
    """A server whose every GET and POST is answered by `answer`; yields its base URL."""

    async def endpoint(request: Request) -> JSONResponse:
        raw = await request.body()
        status, out = answer(request.url.path, await request.json() if raw else None)
        return JSONResponse(out, status)

    return served(Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])]))
