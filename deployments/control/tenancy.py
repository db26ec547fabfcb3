"""Runs joining and leaving a shared fleet: the registry, its records in the bucket, and the runs' adapters on
the replicas, kept in step.

The registry (`deployments.control.runs`) is the ingress's memory; the records (`core.bucket.store.RunRecords`:
name, token sha256, weight, window and rank) are what a restarted ingress remembers it from. So a
registration that cannot be recorded is undone (it would be forgotten by the next ingress), and a record is
deleted before its run is forgotten (it would bring the run back). A run that leaves takes its adapters off
every replica with it, so that its slots serve the others at once instead of waiting for their LRU eviction, and
everything the fleet kept of it: the replicas forget its prefix of the bucket, its names and its cached folders
(`contracts.control.ForgetRun`), the fair share its counters once its last generation is done. A fleet that stays
up for weeks while runs come and go keeps nothing of the runs gone. Replicas need not know of runs: a run's
adapters come back from the bucket on demand, so a replica that restarts loses nothing.

Whether the fleet's own `policy-vN` lineage pins slots at registration is the bucket's to say (`own_lineage`):
only once a version of it is committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from contracts.adapters import run_prefix
from contracts.auth import redact
from deployments.control.backend import Backend
from deployments.control.broadcast import forget_run
from deployments.control.errors import ApiError
from deployments.control.fair_share import FairShare
from deployments.control.offload import offload
from deployments.control.runs import Runs
from deployments.keyed_lock import KeyedLock

log = logging.getLogger("ray.serve")

RECORD, UNLOAD = "deleting its record", "unloading its adapters"  # the steps of a run's leaving


class Tenancy:
    """Register, remove and release the runs of `runs`, with their records (`records`, None: kept nowhere) and their
    share of the fleet (`gate`). `own_lineage` says whether the fleet's own lineage has a committed version (a bucket
    listing, in a worker thread); None: it is counted as if it had.

    Joining and leaving are one serialised step per run name: a registration of a name waits until that name's
    removal or release is done (its record deleted, its adapters unloaded everywhere), so that the end of the old run
    can never delete the new one's record or unload its adapters. What a release could not finish (the bucket or a
    replica did not answer) is retried every round of the upkeep (`finish_leaving`) until done, and a name is not
    registered again before."""

    def __init__(
        self,
        runs: Runs,
        records,
        backend: Backend,
        scrub: Callable[[str], str],
        gate: FairShare,
        own_lineage: Callable[[], bool] | None = None,
    ):
        self.runs, self.records, self.backend, self.scrub = runs, records, backend, scrub
        self.gate, self.own_lineage = gate, own_lineage
        self._names = KeyedLock()  # one join or leave of a name at a time
        self._leaving: dict[str, set[str]] = {}  # runs gone from the registry: what of their leaving is left to do

    async def register(
        self,
        name: str,
        weight: float | None,
        max_staleness: int | None,
        lora_rank: int | None,
        lineages: int | None = None,
    ) -> str:
        """Register and record run `name`; its token (the only time anyone sees it)."""
        async with self._names.hold(name):
            if name in self._leaving and not await self._leave(name):
                raise ApiError(
                    503, f"run {name!r} is still leaving the fleet ({self._pending(name)}); register it again shortly"
                )
            own = True
            if self.own_lineage is not None:
                try:
                    own = await offload(self.own_lineage)
                except Exception as e:  # the records could not be written either: say so now
                    raise ApiError(503, f"the fleet's bucket could not be listed: {e}") from None
            token = self.runs.register(name, weight, max_staleness, lora_rank, own, lineages)
            if self.records is not None:
                try:
                    await offload(self.records.save, name, self.runs.registration(name).as_record())
                except Exception as e:  # unrecorded, it would be forgotten by the next ingress: not registered
                    self.runs.remove(name)
                    raise ApiError(503, f"run {name!r} could not be recorded in the bucket: {e}") from None
        log.info("fleet ingress: registered run %s (%d runs)", name, len(self.runs.names()))
        return token

    async def remove(self, name: str) -> list[str]:
        """Forget run `name` (its token stops working at once) and unload its adapters everywhere; their names."""
        async with self._names.hold(name):
            if name not in self.runs.names():
                raise ApiError(404, f"run {name[:64]!r} is not registered")
            if self.records is not None:  # first: a record left behind would bring the run back after a restart
                try:
                    await offload(self.records.delete, name)
                except Exception as e:
                    raise ApiError(
                        503, f"run {name!r} could not be removed from the bucket, still registered: {e}"
                    ) from None
            self.runs.remove(name)
            self.gate.forget(name)
            self._leaving[name] = {UNLOAD}
            try:
                names = await self._unload(name)
            except Exception:
                log.warning("fleet ingress: removed run %s; its adapters are unloaded by the upkeep", name)
                raise
            self._leaving.pop(name, None)
        log.info("fleet ingress: removed run %s, unloaded %s", name, names or "nothing")
        return names

    async def release_idle(self) -> list[str]:
        """Release the runs gone silent for `fleet.run_idle_timeout_s`, as if removed; their names.

        Their tokens stop working at once; their records and adapters go now, or (the bucket or a replica does not
        answer) in a later round of the upkeep."""
        released = self.runs.take_idle()
        for name in released:
            log.warning("fleet ingress: run %s sent nothing for %.0fs: released", name, self.runs.idle_timeout_s)
            self.gate.forget(name)
            async with self._names.hold(name):
                self._leaving[name] = {RECORD, UNLOAD} if self.records is not None else {UNLOAD}
                await self._leave(name)
        return released

    async def finish_leaving(self) -> list[str]:
        """Try again what the runs released before could not finish; the runs now gone for good."""
        done = []
        for name in list(self._leaving):
            async with self._names.hold(name):
                if name in self._leaving and await self._leave(name):
                    done.append(name)
        return done

    async def _leave(self, name: str) -> bool:
        """The steps of run `name`'s leaving still to do, in order: its record deleted, then its adapters unloaded
        everywhere; whether it is gone for good (a step that fails is logged and tried again later)."""
        pending = self._leaving[name]
        try:
            if RECORD in pending:
                await offload(self.records.delete, name)
                pending.discard(RECORD)
            if UNLOAD in pending:
                await self._unload(name)
                pending.discard(UNLOAD)
        except Exception as e:  # noqa: BLE001 - tried again in the upkeep's next round
            log.warning(
                "fleet ingress: run %s left; %s failed, tried again: %s", name, self._pending(name), self.scrub(repr(e))
            )
            return False
        del self._leaving[name]
        return True

    async def _unload(self, name: str) -> list[str]:
        return await forget_run(self.backend, name)

    def _pending(self, name: str) -> str:
        return " and ".join(sorted(self._leaving.get(name, ()))) or "nothing"

    @property
    def leaving(self) -> list[str]:
        """The runs released whose leaving is not finished yet."""
        return sorted(self._leaving)

    def bucket_url(self, name: str) -> str | None:
        """Run `name`'s prefix of the fleet's bucket (credentials redacted): the only place its adapters load from."""
        return redact(run_prefix(self.records.url, name)) if self.records is not None else None
