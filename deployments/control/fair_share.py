"""Fair share of the fleet between runs: a weighted admission gate for generations, in the ingress.

Without it, generations reach the engines in arrival order, and vLLM queues them first come first
served: a run that sends a burst of 10,000 samples puts every other run behind all of them. The gate
lets at most `budget` generations (`fleet.inflight_budget`: by default what the engines batch at once)
be in flight on the fleet; a request beyond that waits in its own run's queue. When one finishes, the
freed place goes to the waiting run that holds the fewest places for its weight (smallest
`(in_flight + 1) / weight`, the oldest waiter on a tie), so under contention every run holds places in
proportion to its weight (`share`), a run that arrives late gets the very next places until it holds
its share, and no waiting run is passed over forever: one that holds no place gets the next one first,
whatever its weight. It is work-conserving: a place is never
kept free while anyone waits, so a run alone on the fleet uses all of it.

What it does not do: take places back. A burst that filled an idle fleet keeps its generations until
they finish, so a run arriving then waits for the first of them to finish (not for the whole burst).

Admin and anonymous callers (the fleet's own learner, evaluations) are one pseudo-run, `FLEET_TENANT`,
a name no run can have (run names start with a letter or digit). Per run the gate counts requests,
prompt and completion tokens, queue waits, places in flight and waiting; those are in `GET /router/stats`
under `runs`, beside the LoRA slots each run holds, and in Ray metrics tagged `run`
(`deployments.control.run_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deployments.control.run_metrics import RunMetrics

FLEET_TENANT = "_fleet"


@dataclass
class _Waiter:
    order: int  # arrival order, for ties between runs and FIFO within one
    since: float
    granted: asyncio.Future


@dataclass
class _Tenant:
    in_flight: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    waits: int = 0
    wait_total_s: float = 0.0
    wait_max_s: float = 0.0


@dataclass
class Usage:
    """What one generation used, told to the gate when its place is given back (`FairShare.slot`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class FairShare:
    """At most `budget` generations in flight, places shared between runs by `weight_of(run)`."""

    def __init__(
        self,
        budget: int,
        weight_of: Callable[[str], float],
        metrics: RunMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if budget < 1:
            raise ValueError(f"budget: {budget}, expected at least 1")
        self.budget, self._weight_of, self._metrics, self._clock = budget, weight_of, metrics, clock
        self._tenants: dict[str, _Tenant] = {}
        self._in_flight = 0
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[Usage]:
        """A place for one generation of `tenant`, waited for in its queue; the caller fills in the `Usage`."""
        state = self._tenants.setdefault(tenant, _Tenant())
        since = self._clock()
        await self._acquire(tenant, state, since)
        self._waited(tenant, state, self._clock() - since)
        usage = Usage()
        try:
            yield usage
        finally:
            state.prompt_tokens += usage.prompt_tokens
            state.completion_tokens += usage.completion_tokens
            if self._metrics is not None:
                self._metrics.used(tenant, usage.prompt_tokens, usage.completion_tokens)
            self._release(tenant, state)

    async def _acquire(self, tenant: str, state: _Tenant, since: float) -> None:
        if self._in_flight < self.budget and not any(t.waiting for t in self._tenants.values()):
            self._take(tenant, state)
            return
        waiter = _Waiter(next(self._arrivals), since, asyncio.get_running_loop().create_future())
        state.waiting.append(waiter)
        self._report(tenant, state)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            # Cancelled while waiting (the client went away): its place in the queue is gone. Cancelled just
            # after it was granted a place: the place goes to the next waiter.
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(tenant, state)
            else:
                state.waiting.remove(waiter)
                self._report(tenant, state)
            raise

    def _take(self, tenant: str, state: _Tenant) -> None:
        state.in_flight += 1
        state.requests += 1
        self._in_flight += 1
        self._report(tenant, state)

    def _release(self, tenant: str, state: _Tenant) -> None:
        state.in_flight -= 1
        self._in_flight -= 1
        self._report(tenant, state)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand the free places to waiting runs, each to the one holding the fewest for its weight."""
        while self._in_flight < self.budget:
            for state in self._tenants.values():  # a waiter cancelled since is no longer in the race
                while state.waiting and state.waiting[0].granted.done():
                    state.waiting.popleft()
            candidates = [(name, s) for name, s in self._tenants.items() if s.waiting]
            if not candidates:
                return
            # A run holding no place comes first: even a weight whose share is under one place makes progress.
            name, state = min(
                candidates,
                key=lambda c: (c[1].in_flight > 0, (c[1].in_flight + 1) / self._weight_of(c[0]), c[1].waiting[0].order),
            )
            waiter = state.waiting.popleft()
            self._take(name, state)
            waiter.granted.set_result(None)

    def _waited(self, tenant: str, state: _Tenant, wait_s: float) -> None:
        state.waits += 1
        state.wait_total_s += wait_s
        state.wait_max_s = max(state.wait_max_s, wait_s)
        if self._metrics is not None:
            self._metrics.waited(tenant, wait_s)

    def _report(self, tenant: str, state: _Tenant) -> None:
        if self._metrics is not None:
            self._metrics.places(tenant, state.in_flight, len(state.waiting))

    def resize(self, budget: int) -> None:
        """The fleet grew or shrank: `budget` places from now on (places beyond it are given back as they end)."""
        if budget < 1:
            raise ValueError(f"budget: {budget}, expected at least 1")
        self.budget = budget
        self._dispatch()

    def report_slots(self, held: Mapping[str, int]) -> None:
        """Set each run's slots gauge to the LoRA slots its adapters hold on the fullest engine (`held`, from a
        listing of the replicas just made); a run the gate knows of that holds none now reports 0."""
        for tenant in set(held) | set(self._tenants):
            self._tenants.setdefault(tenant, _Tenant())  # known from now on: its gauge goes back to 0 when due
            if self._metrics is not None:
                self._metrics.slots(tenant, held.get(tenant, 0))

    def share(self, tenant: str) -> float:
        """Places `tenant` holds under contention: the budget split by weight between the runs using the fleet now
        (in flight or waiting, `tenant` counted in any case)."""
        active = {name for name, s in self._tenants.items() if s.in_flight or s.waiting} | {tenant}
        return self.budget * self._weight_of(tenant) / sum(self._weight_of(name) for name in active)

    def stats(self, slots_held: Mapping[str, int] | None = None) -> dict[str, Any]:
        """`/router/stats`'s `runs`: per run its weight, share, places in flight and waiting, counters, and the
        LoRA slots it holds (`slots_held`, from a listing of the replicas: a run holding some is listed too)."""
        slots_held = slots_held or {}
        tenants = {name: self._tenants.get(name) or _Tenant() for name in set(self._tenants) | set(slots_held)}
        return {
            "inflight_budget": self.budget,
            "in_flight": self._in_flight,
            "runs": {
                name: {
                    "weight": self._weight_of(name),
                    "share": round(self.share(name), 3),
                    "in_flight": s.in_flight,
                    "queued": len(s.waiting),
                    "requests": s.requests,
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.completion_tokens,
                    "queue_wait_mean_s": round(s.wait_total_s / s.waits, 6) if s.waits else 0.0,
                    "queue_wait_max_s": round(s.wait_max_s, 6),
                    "slots_held": slots_held.get(name, 0),
                }
                for name, s in sorted(tenants.items())
            },
        }
