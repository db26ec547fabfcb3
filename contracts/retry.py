"""One retry policy (jittered exponential backoff with a bound), sync and async, for every boundary.

Who retries what, decided here so that no failure is retried by two layers at once:

- the bucket (`core.bucket.store`): transient store errors (connection, 5xx, throttling, timeouts),
  `bucket.max_attempts` times; s3fs's and botocore's own retries are off.
- HTTP calls to the fleet (`app.fleet_client`): a fleet that cannot be reached, times out or answers
  502/503/504 (starting, or no live replica). Generation requests of the rollout use
  `rollout.max_retries`; a request the fleet rejected (4xx) or failed (500) is not sent again.
- the ingress (`deployments.ingress.shell`): a generation whose replica died mid-request goes to another
  replica; it answers 503 only when no replica is left, which the client above then waits out. A
  generation during which an *engine* died is sent once more at most: if a second engine dies it is
  answered 500 and refused for a while by its fingerprint (`deployments.ingress.poison`), so a request that
  crashes engines cannot go round the fleet.
- the learner group (`app.learner.group`): a step during which a rank died is run once more on the
  restarted group (an actor restart, not a network retry).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
OnRetry = Callable[[BaseException, int, float], None]  # (error, failed attempt number, pause before the next)


@dataclass(frozen=True)
class Backoff:
    """How often and how patiently to try: `attempts` in all, pauses from `first_s` doubling up to `max_s`."""

    attempts: int
    first_s: float
    max_s: float = 30.0
    jitter: bool = True  # so that clients hit by the same outage do not come back in lockstep

    def pause_s(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1-based)."""
        pause = min(self.first_s * 2 ** (attempt - 1), self.max_s)
        return pause * (0.5 + random.random()) if self.jitter else pause


def _pause_or_raise(
    error: Exception,
    attempt: int,
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    on_retry: OnRetry | None,
) -> float:
    """The pause before the next attempt, or `error` raised again when it is the last or not worth another try."""
    if attempt >= backoff.attempts or not retryable(error):
        raise error
    pause = backoff.pause_s(attempt)
    if on_retry is not None:
        on_retry(error, attempt, pause)
    return pause


def retry(
    fn: Callable[[], T],
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    on_retry: OnRetry | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """fn() until it returns; an error that is not `retryable`, or the last attempt's error, goes up unchanged."""
    for attempt in range(1, backoff.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            sleep(_pause_or_raise(exc, attempt, backoff, retryable, on_retry))
    raise ValueError(f"Backoff.attempts must be at least 1, got {backoff.attempts}")


async def aretry(
    fn: Callable[[], Awaitable[T]],
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    on_retry: OnRetry | None = None,
) -> T:
    """The async twin of `retry`: awaits fn() and sleeps on the event loop."""
    for attempt in range(1, backoff.attempts + 1):
        try:
            return await fn()
        except Exception as exc:
            await asyncio.sleep(_pause_or_raise(exc, attempt, backoff, retryable, on_retry))
    raise ValueError(f"Backoff.attempts must be at least 1, got {backoff.attempts}")
