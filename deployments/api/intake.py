"""A request's body, taken in: refused as soon as it is known to be too large, parsed off the event loop.

A body over `fleet.max_request_bytes` is a 413 by its Content-Length, without waiting for a byte of it, else
(chunked, or a Content-Length that lies) as soon as the bytes read cross the limit; the rest is never read.
What a body may then hold is checked by `deployments.api.bodies`, in a worker thread (`offload`) unless it is small.
"""

from __future__ import annotations

from fastapi import Request

from deployments.api.bodies import Body, RequestLimits, parse_body
from deployments.control.errors import ApiError
from deployments.control.offload import INLINE_BODY_BYTES, offload_unless_small


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes: by its Content-Length without
    waiting for a byte, else (chunked, or a Content-Length that lies) while it streams in."""
    too_large = ApiError(413, f"body: larger than the limit of {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, "content-length: not a number")
        if len(declared) > 18 or int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, schema: type[Body], limits: RequestLimits) -> Body:
    """The body as `schema`, within `limits`; a 413 or a 400 that says why not."""
    raw = await read_body(request, limits.max_request_bytes)
    return await offload_unless_small(len(raw) <= INLINE_BODY_BYTES, parse_body, raw, schema, limits.max_json_depth)
