"""A request's body taken in (`deployments.api.intake`): a body over the limit is refused before it is read,
or as soon as the bytes read cross the limit."""

import asyncio
import json

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import BASE, api_settings, request_limits


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
    app = make_app(backend, api_settings(limits=request_limits(max_request_bytes=limit)))
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
