"""Reading a Tinker request and refusing one, with the fleet's own HTTP pieces and the SDK's error shape.

A body is read as the fleet's are (`deployments.api.intake.read_body`: a 413 by its Content-Length before a byte is
read, else while it streams in), then inflated off the event loop when zstd; a refusal is the fleet's `ApiError`,
answered in the SDK's shape, `{"detail": ...}`, with the status the SDK acts on: 400 malformed, 401 unknown key, 404
not this key's, 410 a released session, 413 too large, 429 over capacity (the SDK backs off and retries), 503 the
learner or the fleet unreachable (retried too).
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse
from tinker import types

from deployments.api.intake import read_body
from deployments.control.errors import ApiError
from deployments.control.offload import INLINE_BODY_BYTES, offload, offload_unless_small
from deployments.tinker.paths import PathRefused
from deployments.tinker.wire import TooLarge, WireError, decompress

MAX_LISTED = 1000  # checkpoints one listing page may hold

Model = TypeVar("Model", bound=pydantic.BaseModel)


async def read(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes as sent and once inflated (zstd, in a worker thread)."""
    raw = await read_body(request, limit)
    encoding = request.headers.get("content-encoding")
    try:
        return await offload(decompress, raw, encoding, limit) if raw and encoding else raw
    except TooLarge as exc:
        raise ApiError(413, str(exc)) from None
    except WireError as exc:
        raise ApiError(400, str(exc)) from None


async def parse(request: Request, model: type[Model], limit: int) -> Model:
    """The body as the SDK's request `model` (strict: an unknown field is a 400), parsed in a worker thread unless it
    is small (`offload_unless_small`: a sample request's few hundred bytes cost the loop less than the trip)."""
    raw = await read(request, limit)
    try:
        return await offload_unless_small(len(raw) <= INLINE_BODY_BYTES, model.model_validate_json, raw or b"{}")
    except pydantic.ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:4])
        raise ApiError(400, f"{model.__name__}: {reasons}") from None


def as_json(model: pydantic.BaseModel) -> dict[str, Any]:
    """An SDK reply as its client reads it: JSON, without the fields it leaves unset."""
    return model.model_dump(mode="json", exclude_none=True)


def page(request: Request) -> tuple[int, int]:
    """A listing's `limit` and `offset` query parameters, checked."""
    try:
        limit = int(request.query_params.get("limit", 100))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise ApiError(400, "limit and offset must be integers") from None
    if not (1 <= limit <= MAX_LISTED and offset >= 0):
        raise ApiError(400, f"limit must be 1..{MAX_LISTED} and offset at least 0")
    return limit, offset


def refusal(exc: Exception) -> JSONResponse:
    """A refusal (`ApiError`, or a path or name refused: `PathRefused`) in the SDK's error shape."""
    if isinstance(exc, PathRefused):
        return JSONResponse({"detail": exc.detail}, status_code=400)
    assert isinstance(exc, ApiError)
    return JSONResponse({"detail": exc.message}, status_code=exc.status)


def accepted(request_id: str, model_id: str | None = None, **extra) -> dict[str, Any]:
    """The SDK's answer to a request accepted as a future (`Futures.submit`): its id, to retrieve it by."""
    return as_json(types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra))
