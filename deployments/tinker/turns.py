"""The order of one training client's requests: each runs in its turn, by the `seq_id` the SDK gave it.

The SDK numbers a training client's requests from 1 and sends them one after another; the service may receive them
out of order, so each waits until every number below its own has had its turn. A number the SDK used must never
leave a hole, or every later request of the client waits for ever: a request refused when it arrived (a 400 once
its client was known) and one cancelled before its turn still take their turn (`give_up`), without running. And
whatever hole is left (a request lost on the way) is bounded twice: a number too far ahead of the client's turn is
refused when it arrives (nothing of it is kept), and a turn that waits `wait_s` while a number before it has not
arrived fails, the missing numbers given up, so the client's next requests run again. Waiting behind requests that
did arrive (a slow learner) is not bounded here: they are.
"""

from __future__ import annotations

import asyncio
import contextlib

from deployments.tinker.futures import RequestFailed


class TurnRefused(Exception):
    """A `seq_id` that cannot take a turn: used already (400), or too far ahead of the client's turn (429, which the
    SDK retries while the requests before it run)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Turns:
    """One training client's turns: `claim` a number when its request arrives, run in `turn`, or `give_up` it."""

    def __init__(self, wait_s: float, max_ahead: int, label: str = "this training client"):
        self.wait_s, self.max_ahead, self.label = wait_s, max_ahead, label
        self.next = 1  # the number whose turn it is (the SDK numbers from 1)
        self._claimed: set[int] = set()  # numbers of requests accepted and not yet run or given up
        self._taken: set[int] = set()  # numbers past `next` whose turn is taken already (given up)
        self._waiting: dict[int, asyncio.Future] = {}

    def claim(self, seq_id: int) -> None:
        """Reserve `seq_id` for a request that just arrived, before anything of it is kept."""
        if seq_id < self.next or seq_id in self._claimed or seq_id in self._taken:
            raise TurnRefused(400, f"seq_id {seq_id} of {self.label} was already used")
        if seq_id >= self.next + self.max_ahead:
            raise TurnRefused(
                429,
                f"seq_id {seq_id} of {self.label} is {seq_id - self.next} ahead of its turn ({self.next}); "
                f"at most {self.max_ahead} requests of one training client wait at once",
            )
        self._claimed.add(seq_id)

    def give_up(self, seq_id: int) -> None:
        """`seq_id`'s turn is taken without running: its request was refused, cancelled or has run."""
        self._claimed.discard(seq_id)
        if seq_id >= self.next:
            self._taken.add(seq_id)
        while self.next in self._taken:
            self._taken.discard(self.next)
            self.next += 1
        ready = self._waiting.pop(self.next, None)
        if ready is not None and not ready.done():
            ready.set_result(None)

    @contextlib.asynccontextmanager
    async def turn(self, seq_id: int):
        """Run the body in `seq_id`'s turn (claimed before); RequestFailed when it waited `wait_s` and a number before
        it has still not arrived (the missing ones are then given up)."""
        if seq_id not in self._claimed:
            raise RequestFailed(f"seq_id {seq_id} of {self.label} was already used", "user")
        try:
            if seq_id != self.next:
                ready = self._waiting[seq_id] = asyncio.get_running_loop().create_future()
                while True:
                    try:
                        await asyncio.wait_for(asyncio.shield(ready), self.wait_s)
                        break
                    except TimeoutError:
                        missing = [n for n in range(self.next, seq_id) if n not in self._claimed]
                        if not missing:
                            continue  # every request before it arrived: they run (a slow learner), it waits on
                        for number in missing:
                            self.give_up(number)
                        raise RequestFailed(
                            f"seq_id {seq_id} of {self.label} waited {self.wait_s:g} s for requests before it that "
                            f"never arrived ({len(missing)} of them, given up now); send it again",
                            "user",
                        ) from None
            yield
        finally:
            self._waiting.pop(seq_id, None)
            self.give_up(seq_id)
