"""A replica's LoRA slots: which adapter its engine holds under which name, and which one leaves when a load needs
a slot.

vLLM holds at most `max_loras` adapters and, asked for one more, drops its least recently used one
without a word, even one that requests in flight still name. So the replica keeps the count itself
(served adapters, plus unloaded or replaced ones still draining their requests in flight) and chooses:
never an adapter with requests in flight; first the least recently used of those that no sample should
still need, then (only when the pinned sets overflow the slots) the least recently used pinned one.
Pinned are, per family (`contracts.adapters.family_of`), the versions within `max_staleness` of the
family's newest loaded version: the ones a sample in flight may still name. An evicted bucket version
comes back from the bucket when it is next asked for, so eviction costs a reload, never a 404.

The eviction policy (`pinned`, `eviction_order`) is pure: `AdapterSlots` feeds it what it holds, unit
tests feed it numbers. A name loaded again is compared by the sha256 of its files: the same files are
a no-op, other files a reload (requests in flight finish on the weights they started on).

Nothing here grows with the versions and runs a fleet serves over weeks: a name's lock lives while a load of it
runs, the names unloaded or evicted are remembered only for the newest `REMEMBERED_NAMES` of each, and a run that
leaves (`forget_run`) takes its names, its prefix of the bucket and its cached folders along. An adapter holds its
cached folder while the engine holds it (`core.bucket.fetching.hold`), so no prune deletes it under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from contracts.adapters import AdapterRef, family_of, is_adapter_name, split_run
from contracts.auth import redact
from contracts.control import AdapterInfo, AdapterListing, Loaded, RunForgotten, Unloaded
from contracts.serving import BadRequest, ModelNotFound, ReplicaError
from core.bucket.fetching import HeldFolder
from core.bucket.manifest import folder_digest
from deployments.keyed_lock import KeyedLock
from deployments.replica.adapter_sources import AdapterSources
from deployments.replica.engine import Engine, lora_request

log = logging.getLogger("ray.serve")

# Names unloaded (not to be loaded again on demand) and evicted (for a clear 404) a replica remembers, the newest.
REMEMBERED_NAMES = 1024


# ---- the eviction policy ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What eviction needs to know of a loaded adapter."""

    name: str
    last_used: float  # monotonic seconds of its latest load or request
    inflight: int


def pinned(names: Iterable[str], window: int) -> set[str]:
    """The versioned names within `window` versions of their family's newest: what samples may still use."""
    versions: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        family, version = family_of(name)
        if version is not None:
            versions.setdefault(family, []).append((version, name))
    return {name for held in versions.values() for version, name in held if version > max(held)[0] - window}


def eviction_order(held: Iterable[Held], window: int) -> list[str]:
    """The adapters that may leave the engine, first to go first: idle and unpinned by age of last use,
    then idle and pinned by age of last use. One with requests in flight is never listed."""
    held = list(held)
    keep = pinned((h.name for h in held), window)
    idle = sorted((h for h in held if h.inflight == 0), key=lambda h: h.last_used)
    return [h.name for h in idle if h.name not in keep] + [h.name for h in idle if h.name in keep]


# ---- the slots ---------------------------------------------------------------------------------------


class RecentNames:
    """A set of adapter names that forgets its oldest beyond `limit`, and a run's names when the run leaves."""

    def __init__(self, limit: int = REMEMBERED_NAMES):
        self.limit = limit
        self._names: dict[str, None] = {}  # insertion order: oldest first

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def add(self, name: str) -> None:
        self._names.pop(name, None)
        self._names[name] = None
        while len(self._names) > self.limit:
            del self._names[next(iter(self._names))]

    def discard(self, name: str) -> None:
        self._names.pop(name, None)

    def drop_run(self, run: str) -> None:
        self._names = {name: None for name in self._names if split_run(name)[0] != run}


@dataclass
class _Adapter:
    name: str
    int_id: int
    path: str
    source: str  # bucket URL of the version, or the trusted local folder
    digest: str  # `folder_digest` of the files loaded: what "already loaded" is checked against
    folder: HeldFolder  # held while the engine holds the adapter: no prune deletes it
    load_id: str | None = None  # the broadcast that loaded it, so a failed broadcast undoes only its own loads
    inflight: int = 0
    draining: bool = False
    last_used: float = field(default_factory=time.monotonic)  # its load or latest request: eviction's clock

    def lora_request(self):
        return lora_request(self.name, self.int_id, self.path, self.digest)


class AdapterSlots:
    """The adapters replica `replica`'s engine holds, at most `max_loras`, loaded from `sources`.

    `window` is the versions pinned per family; a load that finds every slot held by requests in flight
    waits up to `slot_wait_s` for one to finish. `base_model` is the name that means no adapter at all.
    """

    def __init__(
        self,
        replica: str,
        engine: Engine,
        sources: AdapterSources,
        *,
        base_model: str,
        max_loras: int,
        window: int,
        slot_wait_s: float,
    ):
        self.replica, self.engine, self.sources, self.base_model = replica, engine, sources, base_model
        self.max_loras, self.window, self.slot_wait_s = max_loras, window, slot_wait_s
        self._adapters: dict[str, _Adapter] = {}  # served now, by name
        self._draining: dict[int, _Adapter] = {}  # no longer served, still in the engine for requests in flight
        self._unloaded = RecentNames()  # bucket versions explicitly unloaded: never resurrected on demand
        self._evicted = RecentNames()  # dropped for a slot: a bucket version comes back on demand
        self._locks = KeyedLock()  # one load of a name at a time
        self._slot_lock = asyncio.Lock()  # one load at a time picks a slot and fills it
        self._slot_freed = asyncio.Event()
        self._ids = itertools.count(1)

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters served now, sorted."""
        return tuple(sorted(self._adapters))

    @property
    def draining(self) -> int:
        """Adapters no longer served that stay in the engine until their requests in flight finish."""
        return len(self._draining)

    def sizes(self) -> dict[str, int]:
        """What it keeps per name and per run, counted (`contracts.control.ReplicaTables`, but the disk cache's)."""
        names = {"name_locks": len(self._locks), "unloaded": len(self._unloaded), "evicted": len(self._evicted)}
        return {**names, **self.sources.sizes()}

    def listing(self) -> AdapterListing:
        return AdapterListing(
            self.replica,
            tuple(
                AdapterInfo(a.name, redact(a.source), a.digest, a.inflight)
                for a in sorted(self._adapters.values(), key=lambda a: a.int_id)
            ),
        )

    # ---- requests ---------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, model: str) -> AsyncIterator:
        """vLLM's LoRA request for `model` (None for the base model), counted as a request in flight until the
        block ends: nothing evicts the adapter meanwhile, and one unloaded or replaced meanwhile leaves the
        engine after its last request."""
        if model == self.base_model:
            yield None
            return
        adapter = await self._adapter_for(model)
        adapter.inflight += 1
        try:
            yield adapter.lora_request()
        finally:
            adapter.inflight -= 1
            adapter.last_used = time.monotonic()
            if adapter.inflight == 0:
                if adapter.draining:
                    await self._remove(adapter)
                self._slot_freed.set()  # an idle adapter is one a waiting load may evict

    async def _adapter_for(self, model: str) -> _Adapter:
        adapter = self._adapters.get(model)
        if adapter is not None:
            return adapter
        ref = AdapterRef.parse(model)
        if ref is not None and model not in self._unloaded and await self.sources.is_committed(ref):
            # Committed, so never a 404: published while this replica was starting, a missed broadcast,
            # or evicted from its LoRA slot. The bucket (the run's prefix of it) is the record; load it now.
            await self.load(model, ref.key)
            adapter = self._adapters.get(model)
            if adapter is not None:  # `use` counts it in flight before anything can evict it
                return adapter
        if model in self._evicted:
            raise ModelNotFound(
                f"adapter {model!r} was evicted from its LoRA slot (least recently used); load it again"
            )
        raise ModelNotFound(f"model {model!r} is not loaded (base model: {self.base_model!r})")

    # ---- loads and unloads (admin calls arrive by broadcast) --------------------------------------------

    async def load(self, name: str, ref: str, load_id: str | None = None) -> Loaded:
        """Pull and add an adapter. Loading a name again is a no-op when the files are the same (by sha256),
        wherever they come from; with other files it is a reload: requests from then on get the new
        weights, requests in flight finish on the old ones, which then leave the engine."""
        if not is_adapter_name(name) or name == self.base_model:
            raise BadRequest(
                f"lora_name {str(name)[:170]!r}: expected letters, digits, '.', '_' or '-', after '<run>/' for a run's"
            )
        async with self._locks.hold(name):
            source, folder = await self.sources.fetch(name, ref)
            try:
                digest = await asyncio.to_thread(folder_digest, folder.path)
                existing = self._adapters.get(name)
                if existing is not None and existing.digest == digest:
                    return Loaded(self.replica, loaded=False)
                adapter = _Adapter(name, next(self._ids), str(folder.path), source, digest, folder, load_id)
                async with self._slot_lock:
                    await self._make_room()
                    await self.engine.add_lora(name, adapter.lora_request())
                    self._adapters[name] = adapter
                folder = None  # the adapter holds it now, until it leaves the engine
            finally:
                if folder is not None:
                    folder.release()
            self._unloaded.discard(name)
            self._evicted.discard(name)
            if existing is not None:
                await self._drain(existing)
            log.info(
                "replica %s %s %s from %s (sha256 %s)",
                self.replica,
                "reloaded" if existing is not None else "loaded",
                name,
                redact(source),
                digest[:12],
            )
        self.sources.tidy_soon()  # one more version in the cache
        return Loaded(self.replica, loaded=True, replaced=existing is not None)

    async def _make_room(self) -> None:
        """Free a LoRA slot for one more adapter, evicting as `eviction_order` orders (never one with requests
        in flight), so that the engine never holds more than `max_loras` and vLLM never has to drop one by
        itself. When every adapter has requests in flight, wait up to `slot_wait_s` for one to finish, then
        refuse (503, worth another try)."""
        deadline = time.monotonic() + self.slot_wait_s
        while len(self._adapters) + len(self._draining) >= self.max_loras:
            order = eviction_order(
                (Held(a.name, a.last_used, a.inflight) for a in self._adapters.values()), self.window
            )
            if order:
                await self._evict(order[0])
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplicaError(
                    f"replica {self.replica}: all {self.max_loras} LoRA slots hold adapters with requests "
                    "in flight; try again",
                    503,
                )
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), remaining)

    async def _evict(self, name: str) -> None:
        overflow = name in pinned(self._adapters, self.window)
        victim = self._adapters.pop(name)
        self._evicted.add(victim.name)
        await self._drain(victim)
        (log.warning if overflow else log.info)(
            "replica %s evicted %s (least recently used%s) to free a LoRA slot",
            self.replica,
            victim.name,
            ", pinned: the families' windows overflow max_loras" if overflow else "",
        )

    async def undo_load(self, name: str, load_id: str) -> Unloaded:
        """Unload `name` only if the broadcast `load_id` loaded it here (rollback of a failed broadcast).

        Undoing a reload leaves the name unloaded, not back on the weights it replaced: those files may
        be gone (a trainer overwrote its folder), and a committed version comes back from the bucket."""
        adapter = self._adapters.get(name)
        if adapter is None or adapter.load_id != load_id:
            return Unloaded(self.replica, unloaded=False)
        return await self.unload(name)

    async def unload(self, name: str) -> Unloaded:
        """Stop accepting requests for `name`; the engine drops it once its in-flight requests finish."""
        if AdapterRef.parse(name) is not None:  # other names are never loaded on demand anyway
            self._unloaded.add(name)
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            return Unloaded(self.replica, unloaded=False)
        await self._drain(adapter)
        return Unloaded(self.replica, unloaded=True, draining=adapter.inflight)

    async def _drain(self, adapter: _Adapter) -> None:
        """`adapter` (no longer under its name) leaves the engine once its in-flight requests finish."""
        if adapter.draining:  # evicted while its own reload waited for a slot
            return
        adapter.draining = True
        if adapter.inflight == 0:
            await self._remove(adapter)
        else:
            self._draining[adapter.int_id] = adapter

    async def _remove(self, adapter: _Adapter) -> None:
        self._draining.pop(adapter.int_id, None)
        try:
            await self.engine.remove_lora(adapter.int_id)
        finally:
            adapter.folder.release()
        self._slot_freed.set()
        self.sources.tidy_soon()  # its folder may go now
        log.info("replica %s removed %s", self.replica, adapter.name)

    async def forget_run(self, run: str) -> RunForgotten:
        """Run `run` left the fleet: unload its adapters (requests in flight finish on them first) and forget its
        names, its prefix of the bucket and its cached folders (those of adapters still draining once they leave)."""
        names = sorted(name for name in self._adapters if split_run(name)[0] == run)
        draining = 0
        for name in names:
            adapter = self._adapters.pop(name)
            draining += adapter.inflight > 0
            await self._drain(adapter)
        self._unloaded.drop_run(run)
        self._evicted.drop_run(run)
        self.sources.forget(run)
        await self.sources.tidy()
        log.info("replica %s forgot run %s (unloaded %s)", self.replica, run, ", ".join(names) or "nothing")
        return RunForgotten(self.replica, tuple(names), draining)
