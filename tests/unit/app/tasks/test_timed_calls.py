"""Blocking calls under a timeout of their own run time, none able to take a thread for ever
(`app.tasks.timed_calls`, which the environment runner and the reward scorer use)."""

import asyncio
import threading
import time

import pytest

from app.tasks.timed_calls import TimedCalls


def test_a_hung_call_gives_its_place_to_the_next_and_its_thread_ends_when_it_returns():
    calls, stuck = TimedCalls(1, 1.0, "test"), threading.Event()
    with pytest.raises(TimeoutError, match="timed out after 1.0s"):
        calls.call(stuck.wait)
    assert calls.abandoned == 1 and calls.call(lambda x: x + 1, 1) == 2  # one place, free again at once
    stuck.set()
    deadline = time.monotonic() + 5
    while calls.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.abandoned == 0


def test_a_call_raising_timeout_error_itself_is_its_own_error_not_a_hang():
    def refuses():
        raise TimeoutError("the environment's own")

    calls = TimedCalls(1, 5.0, "test")
    with pytest.raises(TimeoutError, match="the environment's own"):
        calls.call(refuses)
    assert calls.abandoned == 0


def test_a_cancelled_caller_gives_up_its_call_queued_or_running():
    calls, stuck, ran = TimedCalls(1, 30.0, "test"), threading.Event(), []

    async def main():
        running = asyncio.create_task(calls.acall(stuck.wait))
        queued = asyncio.create_task(calls.acall(ran.append, "queued"))
        await asyncio.sleep(0.1)
        queued.cancel()  # its client went away before it started: it never runs
        running.cancel()  # and this one while it ran: abandoned, its place free for the next
        await asyncio.gather(running, queued, return_exceptions=True)
        assert await asyncio.wait_for(calls.acall(lambda: "next"), 5) == "next"

    try:
        asyncio.run(main())
        assert ran == [] and calls.abandoned == 1
    finally:
        stuck.set()


def test_closing_drops_the_queued_calls_and_refuses_new_ones():
    calls, stuck = TimedCalls(1, 30.0, "test"), threading.Event()

    async def main():
        running = asyncio.create_task(calls.acall(stuck.wait))
        queued = asyncio.create_task(calls.acall(lambda: "never"))
        await asyncio.sleep(0.1)
        calls.close()
        with pytest.raises(asyncio.CancelledError):
            await queued
        stuck.set()
        await running

    asyncio.run(main())
    with pytest.raises(RuntimeError, match="closed"):
        calls.call(print)
