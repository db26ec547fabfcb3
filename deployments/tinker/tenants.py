"""Which tenant an API key is, as the fleet says now, and keeping each tenant's run alive on the fleet.

An API key is `tml-` and a run token; the fleet alone decides whether that run still exists (the admin's
`DELETE /v1/runs/NAME` ends it, and so does `fleet.run_idle_timeout_s` of silence). So a key is remembered (by its
token's sha256) for `max_age_s` at most and then checked with the fleet again: a revoked key is refused by every route
within that bound, and the service drops what it held for the run (`on_revoked`: sessions, training clients,
futures). While the fleet cannot answer, a key it knew is trusted as it was: the fleet that cannot answer cannot have
removed it meanwhile.

The service's requests are the fleet's sign of life of a run only when they use the fleet (sampling, loading); a
tenant that only trains would be released after the fleet's idle timeout, its key dead with it. So every run that
holds a session is sent the fleet's heartbeat (`POST /v1/runs/NAME/heartbeat`) often enough that two in a row may be
lost (`app.fleet_run.FleetRun.heartbeat_s`, the same rule as a run's own driver).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from contracts.auth import token_digest
from contracts.tinker import API_KEY_PREFIX
from deployments.tinker.fleet_calls import FleetRefused, Tenant

log = logging.getLogger("ray.serve")

GONE = (401, 403, 404)  # what the fleet answers a run's token once the run is removed
LONGEST_HEARTBEAT_S = 30.0  # as `app.fleet_run`: a beat at least this often, whatever the fleet's idle timeout

KeyCheck = Callable[[str], Awaitable[Tenant | None]]  # the fleet's answer for an API key now (`FleetCalls.tenant`)
Beat = Callable[[Tenant], Awaitable[float]]  # one heartbeat of a tenant's run; the fleet's idle timeout (s)
Revoked = Callable[[str], Awaitable[None]]  # what the service does once a run is gone: drop all it holds for it


@dataclass
class _Known:
    tenant: Tenant
    checked: float  # the clock when the fleet last said the key is this run's
    used: float  # the clock of its last request
    next_beat: float = 0.0  # the clock when its run is due a heartbeat


class Tenants:
    """The keys the fleet said are runs, each rechecked after `max_age_s`; `on_revoked(run)` once one is gone."""

    def __init__(self, check: KeyCheck, on_revoked: Revoked, max_age_s: float, clock=time.monotonic):
        self._check, self._on_revoked, self.max_age_s, self._clock = check, on_revoked, max_age_s, clock
        self._known: dict[str, _Known] = {}  # token sha256 -> what the fleet said of it
        self._checking: dict[str, asyncio.Task] = {}  # one check of a key at a time, shared by its requests

    async def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant of `api_key`, or None (no key, not `tml-`, not a run's token, or a run since removed). Raises
        `FleetRefused` when the fleet cannot say of a key it never said yes to."""
        if not api_key or not api_key.startswith(API_KEY_PREFIX):
            return None
        digest = token_digest(api_key[len(API_KEY_PREFIX) :])
        known, now = self._known.get(digest), self._clock()
        if known is None or now - known.checked > self.max_age_s:
            task = self._checking.get(digest)
            if task is None:
                task = self._checking[digest] = asyncio.ensure_future(self._recheck(digest, api_key))
                task.add_done_callback(lambda _: self._checking.pop(digest, None))
            known = await asyncio.shield(task)
        if known is not None:
            known.used = now
        return None if known is None else known.tenant

    async def _recheck(self, digest: str, api_key: str) -> _Known | None:
        known = self._known.get(digest)
        try:
            tenant = await self._check(api_key)
        except FleetRefused:
            if known is None:
                raise
            return known  # the fleet cannot answer: it cannot have removed the run meanwhile either
        if tenant is None:
            if known is not None:
                await self.revoke(known.tenant.run, "the fleet no longer knows its key")
            return None
        now = self._clock()
        if known is None or known.tenant != tenant:
            known = self._known[digest] = _Known(tenant, now, now)
        known.checked = now
        return known

    def of(self, run: str) -> Tenant | None:
        """The tenant of run `run`, if a key of it was used here (whom a spot notice's saves are for)."""
        return next((k.tenant for k in self._known.values() if k.tenant.run == run), None)

    async def revoke(self, run: str, why: str) -> None:
        """Forget every key of `run` and have the service drop all it holds for it."""
        digests = [d for d, k in self._known.items() if k.tenant.run == run]
        if not digests:
            return
        for digest in digests:
            del self._known[digest]
        log.warning("tinker: run %s is gone (%s): its sessions, training clients and futures are dropped", run, why)
        await self._on_revoked(run)

    async def keep_alive(self, holding: Iterable[str], beat: Beat) -> None:
        """Send the fleet's heartbeat for each run in `holding` (those with a session) that is due one; a run the
        fleet no longer knows is revoked. A beat that fails otherwise is tried again at the next call."""
        holding = set(holding)
        for known in list(self._known.values()):
            if known.tenant.run not in holding or self._clock() < known.next_beat:
                continue
            try:
                idle_timeout_s = await beat(known.tenant)
            except FleetRefused as refused:
                if refused.status in GONE:
                    await self.revoke(known.tenant.run, f"its heartbeat was refused: {refused.message}")
                else:
                    log.warning("tinker: heartbeat of run %s: %s", known.tenant.run, refused.message)
                continue
            known.next_beat = self._clock() + min(idle_timeout_s / 4, LONGEST_HEARTBEAT_S)

    def forget_idle(self, holding: Iterable[str], idle_s: float) -> None:
        """Forget the keys unused for `idle_s` whose run holds no session: checked again if they come back."""
        holding, now = set(holding), self._clock()
        for digest in [d for d, k in self._known.items() if k.tenant.run not in holding and now - k.used > idle_s]:
            del self._known[digest]

    def __len__(self) -> int:
        return len(self._known)
