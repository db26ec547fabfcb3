"""app.retry: the one backoff policy, sync and async."""

import asyncio

import pytest

from contracts.retry import Backoff, aretry, retry
from tests.support.flaky import Flaky


def test_pauses_double_up_to_the_bound_without_jitter():
    backoff = Backoff(attempts=6, first_s=0.5, max_s=3.0, jitter=False)
    assert [backoff.pause_s(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_jitter_stays_within_half_and_one_and_a_half_times():
    backoff = Backoff(attempts=3, first_s=1.0)
    assert all(0.5 <= backoff.pause_s(1) <= 1.5 for _ in range(200))


def test_retry_until_success_and_report_each_retry():
    flaky, pauses, seen = Flaky(2, ConnectionError("down")), [], []
    result = retry(
        flaky, Backoff(5, 0.1, jitter=False), lambda e: True, lambda e, a, p: seen.append((a, p)), sleep=pauses.append
    )
    assert result == "ok" and flaky.calls == 3
    assert pauses == [0.1, 0.2] and seen == [(1, 0.1), (2, 0.2)]


def test_retry_gives_up_after_the_last_attempt_with_the_original_error():
    flaky, pauses = Flaky(10, ConnectionError("down")), []
    with pytest.raises(ConnectionError, match="down"):
        retry(flaky, Backoff(3, 0.1), lambda e: True, sleep=pauses.append)
    assert flaky.calls == 3 and len(pauses) == 2


def test_an_error_that_is_not_retryable_goes_up_at_once():
    flaky, pauses = Flaky(10, ValueError("bad request")), []
    with pytest.raises(ValueError):
        retry(flaky, Backoff(5, 0.1), lambda e: isinstance(e, ConnectionError), sleep=pauses.append)
    assert flaky.calls == 1 and pauses == []


def test_aretry_awaits_and_retries_the_same_way():
    flaky = Flaky(1, TimeoutError("slow"))

    async def call():
        return flaky()

    assert asyncio.run(aretry(call, Backoff(2, 0.0), lambda e: isinstance(e, TimeoutError))) == "ok"
    assert flaky.calls == 2
    flaky = Flaky(5, TimeoutError("slow"))
    with pytest.raises(TimeoutError):
        asyncio.run(aretry(call, Backoff(2, 0.0), lambda e: True))
    assert flaky.calls == 2
