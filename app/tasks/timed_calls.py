"""Blocking user code (an environment's `reset` and `step`, a reward function) in threads, each call under a timeout
that counts its own run time, and no call able to cost the others a thread for ever.

A Python thread cannot be killed: a call that hangs keeps its thread until it returns, if it ever does. In a fixed
pool each such call takes a worker for good, and once all of them are taken every later call waits in the queue
until its timeout, which counted the wait as well: it failed without ever running. Here a call that runs past its
timeout is abandoned instead: its caller gets `TimeoutError` at once, its place goes to the next call (on a thread
of its own), and its thread ends whenever the call returns (`abandoned` counts those still running, for the logs).
At most `workers` calls that are not abandoned run at once; the others wait, and a call's timeout starts when it
starts. A caller that stops waiting (a cancelled task) gives up its call the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple
    started: cf.Future = field(default_factory=cf.Future)  # set when a thread starts running it
    result: cf.Future = field(default_factory=cf.Future)
    abandoned: bool = False


class TimedCalls:
    """Runs `fn(*args)` on threads named `name`, at most `workers` at once, each for at most `timeout_s` seconds."""

    def __init__(self, workers: int, timeout_s: float, name: str):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"workers {workers} and timeout_s {timeout_s}: expected at least 1 and above 0")
        self.workers, self.timeout_s, self.name = workers, timeout_s, name
        self._lock = threading.Lock()
        self._queue: deque[_Call] = deque()
        self._running = 0  # places taken: calls running that are not abandoned
        self._abandoned = 0  # calls given up on whose thread still runs
        self._closed = False

    @property
    def abandoned(self) -> int:
        """Calls given up on (past their timeout) whose thread has not returned yet."""
        return self._abandoned

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`'s result or exception, waiting for a place first; TimeoutError once it has run `timeout_s`."""
        call = self._submit(fn, args)
        call.started.result()  # the wait for a place counts against no timeout
        try:
            return call.result.result(timeout=self.timeout_s)
        except TimeoutError:
            if call.result.done():  # fn's own TimeoutError, or it returned just now
                return call.result.result()
            self._abandon(call)
            raise self._timed_out(fn) from None

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`call` for a coroutine: the event loop is never blocked, and a cancelled caller gives up its call."""
        call = self._submit(fn, args)
        try:
            await asyncio.shield(asyncio.wrap_future(call.started))
        except asyncio.CancelledError:
            if not call.result.cancel():  # started meanwhile: nobody waits for it any more
                self._abandon(call)
            raise
        result = asyncio.wrap_future(call.result)
        try:
            done, _ = await asyncio.wait({result}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            self._abandon(call)
            raise
        if not done and self._abandon(call):
            raise self._timed_out(fn)
        return await result

    def close(self) -> None:
        """Refuse new calls and drop the queued ones; calls running (hung ones too) are left to end by themselves."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for call in queued:
            call.result.cancel()
            call.started.cancel()

    # ---- plumbing ------------------------------------------------------------------------------------

    def _timed_out(self, fn: Callable[..., Any]) -> TimeoutError:
        name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", repr(fn))
        return TimeoutError(f"{name} timed out after {self.timeout_s:.1f}s ({self._abandoned} calls hung so far)")

    def _submit(self, fn: Callable[..., Any], args: tuple) -> _Call:
        call = _Call(fn, args)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} calls: closed")
            self._queue.append(call)
            self._start_queued()
        return call

    def _start_queued(self) -> None:
        """Start queued calls while places are free (under the lock)."""
        while self._running < self.workers and self._queue:
            call = self._queue.popleft()
            if not call.result.set_running_or_notify_cancel():  # its caller went away while it waited
                continue
            self._running += 1
            threading.Thread(target=self._run, args=(call,), name=self.name, daemon=True).start()

    def _run(self, call: _Call) -> None:
        call.started.set_result(None)
        try:
            value = call.fn(*call.args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
            call.result.set_exception(e)
        else:
            call.result.set_result(value)
        with self._lock:
            if call.abandoned:
                self._abandoned -= 1
            else:
                self._running -= 1
                self._start_queued()

    def _abandon(self, call: _Call) -> bool:
        """Give up on a running call: its place goes to the next one. False if it has finished meanwhile."""
        with self._lock:
            if call.result.done() or call.abandoned:
                return False
            call.abandoned = True
            self._running -= 1
            self._abandoned += 1
            self._start_queued()
        return True
