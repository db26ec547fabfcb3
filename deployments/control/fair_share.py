"""Fair share of the fleet between runs: a weighted admission gate for generations, in the ingress.

Without it, generations reach the engines in arrival order, and vLLM queues them first come first
served: a run that sends a burst of 10,000 samples puts every other run behind all of them. The gate
counts places in sequences, the unit the engines batch: a generation of `n` completions (spotrl's own groups ask
for `n=G`) holds `n` places. At most `budget` places (`fleet.inflight_budget`: by default what the engines batch at
once, `num_replicas x max_num_seqs`) are held on the fleet at once; a generation beyond that waits in its own run's
queue. When one finishes, the freed places go to the waiting run that holds the fewest places for its weight
(smallest `(in_flight + n) / weight`, the oldest waiter on a tie), once that many are free (the free places are
kept for it meanwhile: a large generation is never passed over by smaller ones, which would starve it), so under
contention every run holds places in proportion to its weight (`share`), a run that arrives late gets the very
next places until it holds its share, and no waiting run is passed over forever: once no run's next generation
fits within its share, one that holds no place comes next, whatever its weight or the size of its generation.
It is work-conserving up to that: places are kept free only while the next waiter's generation does not fit yet,
so a run alone on the fleet uses all of it. A generation of more sequences than the
budget holds the whole budget.

What it does not do: take places back. A burst that filled an idle fleet keeps its generations until
they finish, so a run arriving then waits for the first of them to finish (not for the whole burst).

Admin and anonymous callers (the fleet's own learner, evaluations) are one pseudo-run, `FLEET_TENANT`,
a name no run can have (run names start with a letter or digit). Per run the gate counts requests,
prompt and completion tokens, queue waits, places (sequences) in flight and waiting; those are in
`GET /router/stats` under `runs`, beside the LoRA slots each run holds, and in Ray metrics tagged `run`
(`deployments.control.run_metrics`). A run that leaves the fleet (`is_run` says no more) is forgotten, counters
and gauges, as soon as it has nothing in flight or waiting: the gate keeps nothing of runs long gone.
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
    places: int  # the generation's sequences
    granted: asyncio.Future  # its result: the places granted (the budget at most, whatever it is by then)


@dataclass
class _Tenant:
    in_flight: int = 0  # places: sequences
    waiting: deque[_Waiter] = field(default_factory=deque)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    waits: int = 0
    wait_total_s: float = 0.0
    wait_max_s: float = 0.0

    @property
    def queued(self) -> int:
        """Places (sequences) its waiting generations ask for."""
        return sum(w.places for w in self.waiting)

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.waiting


@dataclass
class Usage:
    """What one generation used, told to the gate when its place is given back (`FairShare.slot`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class FairShare:
    """At most `budget` sequences in flight, places shared between runs by `weight_of(run)`; a tenant for which
    `is_run` says no (a run since removed) is forgotten once idle. `FLEET_TENANT` is never forgotten."""

    def __init__(
        self,
        budget: int,
        weight_of: Callable[[str], float],
        metrics: RunMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        is_run: Callable[[str], bool] = lambda tenant: True,
    ):
        if budget < 1:
            raise ValueError(f"budget: {budget}, expected at least 1")
        self.budget, self._weight_of, self._metrics, self._clock = budget, weight_of, metrics, clock
        self._is_run = is_run
        self._tenants: dict[str, _Tenant] = {}
        self._slot_gauges: set[str] = set()  # tenants whose slots gauge is not 0
        self._next: tuple[str, _Waiter] | None = None  # chosen, the free places kept for it until it fits
        self._in_flight = 0
        self._arrivals = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, places: int = 1, requests: int = 1) -> AsyncIterator[Usage]:
        """Places for one generation of `tenant`: its `places` sequences (`n`; the whole budget at most), waited for
        in its run's queue; the caller fills in the `Usage`. `requests`: the clients' requests it serves (several
        when like ones were merged into one engine call), what the run's request counter counts."""
        places = max(1, places)
        state = self._tenants.setdefault(tenant, _Tenant())
        since = self._clock()
        granted = await self._acquire(tenant, state, places, since)
        state.requests += requests
        self._waited(tenant, state, self._clock() - since, requests)
        usage = Usage()
        try:
            yield usage
        finally:
            state.prompt_tokens += usage.prompt_tokens
            state.completion_tokens += usage.completion_tokens
            if self._metrics is not None:
                self._metrics.used(tenant, usage.prompt_tokens, usage.completion_tokens)
            self._release(tenant, state, granted)

    def _fitted(self, places: int) -> int:
        """The places a generation of `places` sequences takes now: the whole budget at most, whatever it is now (a
        waiter larger than a budget since shrunk would otherwise wait for ever, and every run behind it)."""
        return min(places, self.budget)

    async def _acquire(self, tenant: str, state: _Tenant, places: int, since: float) -> int:
        """Wait for the places of a generation of `places` sequences; the places granted."""
        need = self._fitted(places)
        if self._in_flight + need <= self.budget and not any(t.waiting for t in self._tenants.values()):
            self._take(tenant, state, need)
            return need
        waiter = _Waiter(next(self._arrivals), since, places, asyncio.get_running_loop().create_future())
        state.waiting.append(waiter)
        self._report(tenant, state)
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            # Cancelled while waiting (the client went away): its place in the queue is gone. Cancelled just
            # after it was granted its places: they go to the next waiters.
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(tenant, state, waiter.granted.result())
            else:
                if waiter in state.waiting:  # else a dispatch dropped it already, as a waiter cancelled
                    state.waiting.remove(waiter)
                self._report(tenant, state)
                self._dispatch()  # it may have been the one the free places were kept for
                self._forget_if_gone(tenant, state)
            raise

    def _take(self, tenant: str, state: _Tenant, places: int) -> None:
        state.in_flight += places
        self._in_flight += places
        self._report(tenant, state)

    def _release(self, tenant: str, state: _Tenant, places: int) -> None:
        state.in_flight -= places
        self._in_flight -= places
        self._report(tenant, state)
        self._dispatch()
        self._forget_if_gone(tenant, state)

    def _dispatch(self) -> None:
        """Hand the free places to waiting runs, each to the one holding the fewest for its weight. A generation
        chosen so that does not fit yet has the next free places kept for it, whoever is chosen after it would be:
        never passed over by smaller ones, which would starve it."""
        while True:
            for state in self._tenants.values():  # a waiter cancelled since is no longer in the race
                while state.waiting and state.waiting[0].granted.done():
                    state.waiting.popleft()
            if self._next is not None and self._next[1].granted.done():
                self._next = None
            if self._next is None:
                if self._in_flight >= self.budget:  # nothing to hand out: choose when something is
                    return
                self._next = self._choose()
            if self._next is None:
                return
            name, waiter = self._next
            need = self._fitted(waiter.places)
            if self._in_flight + need > self.budget:
                return
            self._next = None
            state = self._tenants[name]
            state.waiting.remove(waiter)
            self._take(name, state, need)
            waiter.granted.set_result(need)

    def _choose(self) -> tuple[str, _Waiter] | None:
        """The next waiter to be granted places, the head of its run's queue: first a run whose generation keeps it
        within its share, then a run holding no place, then the rest; in each, the run holding the fewest places for
        its weight once granted, the oldest waiter on a tie."""
        candidates = [(name, s) for name, s in self._tenants.items() if s.waiting]
        if not candidates:
            return None
        active = self._weight_in_use()

        def rank(candidate: tuple[str, _Tenant]) -> tuple:
            name, state = candidate
            after = state.in_flight + self._fitted(state.waiting[0].places)
            weight = self._weight_of(name)
            # Within its share first: a run of small generations is not held back to one of them per large one
            # of another run's. Then a run holding no place: a weight whose share is under one place, or a
            # generation larger than its run's share, still makes progress.
            return (after > self.budget * weight / active, state.in_flight > 0, after / weight, state.waiting[0].order)

        name, state = min(candidates, key=rank)
        return name, state.waiting[0]

    def _waited(self, tenant: str, state: _Tenant, wait_s: float, requests: int) -> None:
        state.waits += 1
        state.wait_total_s += wait_s
        state.wait_max_s = max(state.wait_max_s, wait_s)
        if self._metrics is not None:
            self._metrics.waited(tenant, wait_s, requests)

    def _report(self, tenant: str, state: _Tenant) -> None:
        if self._metrics is not None:
            self._metrics.places(tenant, state.in_flight, state.queued)

    def forget(self, tenant: str) -> None:
        """`tenant` left the fleet: forget it now if it has nothing in flight or waiting, else when it has none."""
        state = self._tenants.get(tenant)
        if state is not None:
            self._forget_if_gone(tenant, state)

    def _forget_if_gone(self, tenant: str, state: _Tenant) -> None:
        if tenant == FLEET_TENANT or not state.idle or self._is_run(tenant) or self._tenants.get(tenant) is not state:
            return
        del self._tenants[tenant]
        if self._metrics is not None:
            self._metrics.forget(tenant)

    def resize(self, budget: int) -> None:
        """The fleet grew or shrank: `budget` places from now on (places beyond it are given back as they end; a
        waiter larger than the new budget takes the whole of it)."""
        if budget < 1:
            raise ValueError(f"budget: {budget}, expected at least 1")
        self.budget = budget
        self._dispatch()

    def report_slots(self, held: Mapping[str, int]) -> None:
        """Set each run's slots gauge to the LoRA slots its adapters hold on the fullest engine (`held`, from a
        listing of the replicas just made); a run that held some at the last report and holds none now reports 0."""
        if self._metrics is not None:
            for tenant in set(held) | self._slot_gauges:
                self._metrics.slots(tenant, held.get(tenant, 0))
        self._slot_gauges = {tenant for tenant, n in held.items() if n}

    def share(self, tenant: str) -> float:
        """Places `tenant` holds under contention: the budget split by weight between the runs using the fleet now
        (in flight or waiting, `tenant` counted in any case)."""
        return self.budget * self._weight_of(tenant) / self._weight_in_use(tenant)

    def _weight_in_use(self, tenant: str | None = None) -> float:
        """The weights of the runs using the fleet now (in flight or waiting), `tenant` counted in any case."""
        active = {name for name, s in self._tenants.items() if not s.idle} | ({tenant} if tenant is not None else set())
        return sum(self._weight_of(name) for name in active)

    def sizes(self) -> dict[str, int]:
        """How many tenants the gate keeps, and how many slots gauges it keeps up (`/server_info`'s tables)."""
        return {"fair_share_tenants": len(self._tenants), "slots_gauges": len(self._slot_gauges)}

    def stats(self, slots_held: Mapping[str, int] | None = None) -> dict[str, Any]:
        """`/router/stats`'s `runs`: per run its weight, share, places (sequences) in flight and waiting, counters,
        and the LoRA slots it holds (`slots_held`, from a listing of the replicas: a run holding some is listed too)."""
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
                    "queued": s.queued,
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
