"""The SDK's futures: a request is accepted at once (`UntypedAPIFuture`) and its result fetched by id.

Every accepted request runs as an asyncio task of the service; `/api/v1/retrieve_future` waits for it up to
`poll_wait_s` (a long poll, so a client asks a few times a minute, not hundreds) and then answers the SDK's
`try_again`. A result is one of `Result`'s two forms (JSON, or protobuf for the types the SDK reads as protobuf); a
request that failed after it was accepted is answered as the SDK's `RequestFailedResponse`, its category `user` for
a bad request and `server` otherwise. A future belongs to the tenant that made it: another key's id is unknown.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    """A finished request's answer: a JSON object, or a protobuf body (`ForwardBackwardOutput`, `SampleResponse`)."""

    json: dict | None = None
    proto: bytes | None = None


class RequestFailed(Exception):
    """A request that cannot succeed as sent (`user`) or that the service could not carry out (`server`)."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.message, self.category = message, category


@dataclass
class _Entry:
    tenant: str
    task: asyncio.Task


class Futures:
    """The accepted requests of every tenant, by id, until retrieved (or `ttl_s` after they finish)."""

    def __init__(self, ttl_s: float, clock=time.monotonic):
        self.ttl_s, self._clock = ttl_s, clock
        self._entries: dict[str, _Entry] = {}
        # The finished ones in the order they finished, so that expiring looks at the expired alone: an RL step
        # submits hundreds at once, and a scan of every entry at each would cost the loop more than the rest of it.
        self._finished: deque[tuple[float, str]] = deque()

    def submit(self, tenant: str, work: Awaitable[Result]) -> str:
        """Start `work` now and return the id the SDK will retrieve it by."""
        self._expire()
        request_id = uuid.uuid4().hex
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _: self._finished.append((self._clock(), request_id)))
        self._entries[request_id] = _Entry(tenant, task)
        return request_id

    def owned(self, request_id: str, tenant: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.tenant == tenant

    async def wait(self, request_id: str, timeout_s: float) -> Result | RequestFailed | None:
        """The request's result (or its failure), or None when it is still running after `timeout_s`."""
        entry = self._entries[request_id]
        await asyncio.wait({entry.task}, timeout=timeout_s)  # never raises, never cancels the task
        if not entry.task.done():
            return None
        try:
            return entry.task.result()
        except RequestFailed as failed:
            return failed
        except Exception as exc:  # noqa: BLE001 - any other failure is the service's, and said so
            return RequestFailed(f"{type(exc).__name__}: {exc}", "server")

    def cancel(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            entry.task.cancel()

    def cancel_tenant(self, tenant: str) -> int:
        """Cancel and forget every future of `tenant` (a key the fleet revoked); how many there were."""
        mine = [r for r, e in self._entries.items() if e.tenant == tenant]
        for request_id in mine:
            self.cancel(request_id)
        return len(mine)

    def _expire(self) -> None:
        now = self._clock()
        while self._finished and now - self._finished[0][0] > self.ttl_s:
            _, request_id = self._finished.popleft()
            self._entries.pop(request_id, None)  # cancelled or dropped with its tenant already, perhaps

    def __len__(self) -> int:
        return len(self._entries)
