"""The tinker paths the service handed out, as a route reaches them: the tenant's `PathRegistry` in the bucket, read in
a worker thread and never through a learner (a listing waits for no training, nor for a lost learner).

The learner answers numbers; the service records the path it gives the user for one (`remember`) and finds the
number behind a path again (`recall`): its own paths from memory, else from the bucket, where they were recorded (so a
service that restarted knows the paths it handed out before); another key's published path every time (its owner may
take it back). A path is taken only by the routes of its record's kind (`require_kind`): each kind numbers from 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from contracts.tinker import Lineage
from core.bucket.tinker_registry import PathRegistry
from deployments.control.errors import ApiError
from deployments.tinker.callers import Callers
from deployments.tinker.fleet_calls import Tenant
from deployments.tinker.paths import require_kind
from deployments.tinker.sessions import Model, Sessions

T = TypeVar("T")


class TenantPaths:
    """Each tenant's registry of tinker paths, and the numbers of those this service handed out, by kind."""

    def __init__(self, callers: Callers, sessions: Sessions):
        self.callers, self.sessions = callers, sessions

    def _known(self, kind: str) -> dict[str, tuple[str, int]]:
        """Paths handed out here, by kind: tinker path -> (tenant, number)."""
        return self.sessions.sampler_paths if kind == "sampler" else self.sessions.state_paths

    async def read(self, tenant: Tenant, what: str, call: Callable[[PathRegistry], T]) -> T:
        """`call` of the tenant's registry, from a route that answers at once: a bucket or fleet that cannot answer is
        a 503 naming `what`; what the registry refuses (`ValueError`) stays the caller's to answer."""
        registry = PathRegistry(await self.callers.lineage_now(tenant))
        try:
            return await asyncio.to_thread(call, registry)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the bucket unreachable, or failing
            raise ApiError(503, f"{what}: the bucket could not answer: {type(exc).__name__}: {exc}") from None

    async def record(self, tenant: Tenant, path: str) -> dict | None:
        """`PathRegistry.record` of the tenant's `path`: its own, or another key's published one (with `prefix`)."""
        return await self.read(tenant, f"path {path[:200]!r}", lambda registry: registry.record(path))

    async def recall(self, tenant: Tenant, path: str, kind: str) -> tuple[int, str | None] | None:
        """The number of `kind` that the tinker `path` names for this tenant, and where: None for its own prefix, else
        the prefix of the tenant that published it. None for a path the tenant cannot reach; a 400 for one whose
        record is of another `kind` (its number would name another checkpoint)."""
        known = self._known(kind)
        saved = known.get(path)
        if saved is not None and saved[0] == tenant.run:
            return saved[1], None
        record = await self.record(tenant, path)
        if record is None:
            return None
        require_kind(record, kind, path)
        if record.get("prefix") is None and record.get("expires") is None:
            known[path] = (tenant.run, int(record["number"]))
        return int(record["number"]), record.get("prefix")

    async def remember(
        self, model: Model, lineage: Lineage, path: str, kind: str, number: int, expires: float | None, **extra
    ) -> None:
        """Record `path` for `number` of `kind`, saved by training client `model` (`PathRegistry.remember`, with its
        adapter's spec and `extra`: `user_metadata`, `size_bytes`), from work in a future. One that does not expire is
        remembered here too (one that expires is always looked up in the bucket, where its expiry is)."""
        registry = PathRegistry(lineage)
        await asyncio.to_thread(registry.remember, path, kind, number, model.model_id, model.adapter, expires, **extra)
        if kind != "external" and expires is None:
            self._known(kind)[path] = (model.tenant, number)

    def forget(self, path: str) -> None:
        """`path` is looked up in the bucket from now on (deleted, or given an expiry)."""
        self.sessions.sampler_paths.pop(path, None)
        self.sessions.state_paths.pop(path, None)
