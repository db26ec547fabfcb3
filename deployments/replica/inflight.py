"""A replica's generations in flight: how many sequences they hold, and cutting them short with what they have so far.

Two jobs need the same bookkeeping. The fleet autoscales on sequences in flight per replica (each request counts
its `n`: `deployments.autoscaling`), and a replica whose node is going hands its unfinished generations back to
the ingress before the node goes (`deployments.replica.notices`), which continues each one elsewhere from its
tokens so far (`deployments.ingress.handback`). Handing back is vLLM's abort, which keeps a request's partial output
(token ids and their log-probs, every choice of an n > 1 request): the generation's caller gets those choices,
finish reason `contracts.serving.ABORTED`, marked handed back. Partial rollouts cut the same way (`cut`), but
unmarked: the run continues its generations itself, under a newer adapter version. A generation still waiting to
reach the engine (its adapter loading, every LoRA slot busy) is cut as well: it never starts, and answers at once
with no token (`start`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from deployments.replica.engine import Engine


@dataclass
class _Generation:
    model: str
    sequences: int
    started: bool = False  # handed to the engine (before: waiting for its adapter or a LoRA slot)
    stopped: bool = False  # cut or handed back before it started: it never reaches the engine


class InFlight:
    """The generations `engine` serves now, by request id."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._generations: dict[str, _Generation] = {}
        self._handed_back: set[str] = set()

    @contextlib.contextmanager
    def track(self, model: str, sequences: int) -> Iterator[str]:
        """A generation of `sequences` sequences under `model`, in flight until the block ends; yields the request id
        to hand the engine (`Engine.sample`)."""
        request_id = uuid.uuid4().hex
        self._generations[request_id] = _Generation(model, sequences)
        try:
            yield request_id
        finally:
            del self._generations[request_id]

    def start(self, request_id: str) -> bool:
        """The generation goes to the engine now, unless it was cut or handed back while it waited (for its adapter,
        a LoRA slot): then False, and it must answer at once without sampling (an abort cannot stop what the engine
        has not seen yet)."""
        generation = self._generations[request_id]
        generation.started = True
        return not generation.stopped

    def was_handed_back(self, request_id: str) -> bool:
        """Whether `hand_back` cut this generation short (asked once, as it ends)."""
        if request_id in self._handed_back:
            self._handed_back.discard(request_id)
            return True
        return False

    @property
    def requests(self) -> int:
        return len(self._generations)

    @property
    def sequences(self) -> int:
        """Sequences in flight (a request of n samples counts n), running or waiting in the engine."""
        return sum(g.sequences for g in self._generations.values())

    async def hand_back(self) -> int:
        """Cut short every generation in flight: each answers its tokens so far, marked handed back (the ingress
        continues it elsewhere). Returns how many were cut."""
        ids = list(self._generations)
        self._handed_back.update(ids)
        await self._stop(ids)
        return len(ids)

    async def cut(self, models: tuple[str, ...]) -> int:
        """Cut short the generations under `models`: each answers its caller its tokens so far, finish reason
        `ABORTED`, unmarked (the caller continues it). Returns how many were cut."""
        ids = [rid for rid, g in self._generations.items() if g.model in models]
        await self._stop(ids)
        return len(ids)

    async def _stop(self, ids: list[str]) -> None:
        """Abort those the engine runs; mark those still waiting to start, which then never reach it."""
        for rid in ids:
            generation = self._generations[rid]
            generation.stopped = not generation.started
        await self.engine.abort([rid for rid in ids if self._generations[rid].started])
