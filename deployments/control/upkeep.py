"""The ingress's background upkeep: the chores that no request should wait for, and no GET should do.

Every few seconds, in a task of the ingress's own event loop (started and stopped with the app, `lifespan`),
it releases the runs gone silent (`Tenancy.release_idle`: bucket I/O and unload broadcasts, which would
otherwise delay whichever request came next) and finishes what an earlier release could not (`finish_leaving`), refreshes the per-run gauge of LoRA slots held from a
listing of the replicas (`FairShare.report_slots`), which reading `/router/stats` or `/v1/models` used to
do, and sizes the fair share's budget to the replicas live now (`follow_fleet`: an elastic fleet grows and
shrinks, a lost node takes its replicas' places with it until their replacements run). Requests, GETs above
all, change nothing of it: a run is released within `period_s` of its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from deployments.control.backend import Backend
from deployments.control.broadcast import slots_held
from deployments.control.fair_share import FairShare
from deployments.control.membership import Membership
from deployments.control.tenancy import Tenancy

log = logging.getLogger("ray.serve")

# The longest pause between two rounds: a run is released at most this long after its idle timeout.
MAX_PERIOD_S = 5.0


class Upkeep:
    """Release idle runs and refresh the slots gauges, every `period_s` (a quarter of the idle timeout, at most
    `MAX_PERIOD_S`)."""

    def __init__(
        self,
        tenancy: Tenancy,
        backend: Backend,
        gate: FairShare,
        membership: Membership | None = None,
        inflight_per_replica: int | None = None,
    ):
        self.tenancy, self.backend, self.gate = tenancy, backend, gate
        self.membership, self.inflight_per_replica = membership, inflight_per_replica
        self.period_s = min(tenancy.runs.idle_timeout_s / 4, MAX_PERIOD_S)

    async def once(self) -> None:
        """One round of every chore; one that fails is logged and tried again next round, the others still run."""
        for chore in (self.tenancy.release_idle, self.tenancy.finish_leaving, self.refresh_slots, self.follow_fleet):
            try:
                await chore()
            except Exception as e:  # noqa: BLE001 - the loop must outlive any one round
                log.warning("fleet ingress: upkeep %s failed: %s", chore.__name__, self.tenancy.scrub(repr(e)))

    async def refresh_slots(self) -> None:
        self.gate.report_slots(await slots_held(self.backend))

    async def follow_fleet(self) -> None:
        """The gate admits what the live replicas' engines batch (a fixed `fleet.inflight_budget` stays)."""
        if self.membership is None or self.inflight_per_replica is None:
            return
        self.gate.resize(await self.membership.live() * self.inflight_per_replica)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.once()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan (`FastAPI(lifespan=...)`): the upkeep runs while the app serves."""
        task = asyncio.create_task(self.run(), name="spotrl-ingress-upkeep")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
