"""Where a replica's adapters come from: the fleet's bucket (a run's prefix of it, for a run's adapters) or a
trusted local folder, and which committed versions there are to serve.

A replica that starts loads `AdapterSources.to_serve()` (the newest `max_staleness + 1`), and one asked
for a version it does not hold loads it if `AdapterSources.is_committed` says so (published while it was
starting, a missed broadcast, or evicted from its LoRA slot: a committed version is never a 404).
`CommittedVersions` asks the bucket on the replica's behalf, sparingly: a request for a version the
replica does not know must not become a bucket listing each (fees, throttling that would hit the
learner's publishes too). What a fetch fails with is what the ingress answers: a reference outside the
bucket is a 400, a version never committed a 404, a corrupted one a 502, a bucket out of reach a 503.

A fleet stays up for weeks while runs come and go, so nothing here grows with them: what a replica knows of a
prefix's versions is the bucket's last listing (bounded by the learner's gc) and the few fetched since; a run that
left (`forget`) takes its prefix along; the disk cache (`tidy`) keeps per prefix the versions in use (held by the
engine or being loaded: `core.bucket.fetching.hold`, which also protects them from the other replicas of the
machine) and the newest `cache_keep` others (the other lineages a teacher is loaded from alike), and a run that left
is deleted from it whole once nothing of it is in use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from contracts.adapters import BUCKET_STEMS, POLICY_STEM, AdapterRef, run_prefix, split_run, split_version_url
from contracts.auth import Secret, lineage_key, redact
from contracts.serving import BadRequest, ModelNotFound, ReplicaError
from core.bucket.fetching import HeldFolder
from core.bucket.filesystem import BucketError, IntegrityError, InvalidName, NotSigned, VersionNotFound
from core.bucket.store import AdapterStore, adapter_store
from core.config import BucketConfig

log = logging.getLogger("ray.serve")

# How often a replica may list the bucket for versions newer than the newest it knows.
LISTING_INTERVAL_S = 5.0
# How soon a replica tries again to delete the cached folders of a run gone that another replica of the node held.
LEAVING_RETRY_S = 5.0
# Versions fetched since the last listing that a replica remembers, the newest; an older one asked for again is found
# by a listing (at once: forgetting one makes the next listing due).
FETCHED_REMEMBERED = 16


def newest(versions: Iterable[int], window: int) -> list[int]:
    """The newest `window` of `versions`, oldest first (so an engine's LRU order matches age)."""
    return sorted(set(versions))[-window:] if window > 0 else []


class CommittedVersions:
    """A replica's knowledge of the committed versions: the bucket's last listing, and the versions it fetched.

    Versions are committed in increasing order, so a version older than the newest listed that the
    listing lacks is not going to appear: it is refused without asking the bucket. Only a version
    newer than the newest listed makes the replica list again, at most once every `min_interval_s`
    (the start-up listing does not count: a version published as the replica joined is found at once),
    and requests that arrive while a listing runs wait for it and share it. Within the interval a
    version still unknown is refused (404): a flood of requests for versions nobody published
    must neither list the bucket nor wait, and a missed version a client asks for again is found
    by the next listing. Of the versions fetched since the last listing it remembers the newest
    `FETCHED_REMEMBERED`: a lineage that trains for weeks is fetched version by version, never listed.
    """

    def __init__(
        self,
        store: AdapterStore,
        window: int,
        min_interval_s: float = LISTING_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.window, self.min_interval_s, self._clock = store, window, min_interval_s, clock
        self._listed: list[int] = []
        self._fetched: set[int] = set()
        self._listed_at = float("-inf")
        self._lock = asyncio.Lock()

    async def to_serve(self) -> list[int]:
        """The versions a replica should serve now (listed afresh: at start-up), oldest first.

        This listing does not start the interval: a replica that joins while a version is published may miss its
        load broadcast (Serve's handles learn of a new replica a moment later), and the first request for that
        version must find it by listing again at once, not be refused for `min_interval_s`."""
        async with self._lock:
            await self._list()
            self._listed_at = float("-inf")
        return newest(self._listed, self.window)

    async def is_committed(self, version: int) -> bool:
        """Whether to load `version` on demand: it is committed (however old; gc may yet remove it)."""
        if version > self._newest_listed and version not in self._fetched:
            async with self._lock:
                # A listing that ended while this request waited for the lock answers it as well.
                if version > self._newest_listed and self._clock() - self._listed_at >= self.min_interval_s:
                    await self._list()
        return version in self._listed or version in self._fetched

    def remember(self, version: int) -> None:
        """`version` was fetched from the bucket (by broadcast, after the last listing): it is committed."""
        self._fetched.add(version)
        if len(self._fetched) > FETCHED_REMEMBERED:
            self._fetched.remove(min(self._fetched))
            self._listed_at = float("-inf")  # the one forgotten is found by the next listing, due at once

    @property
    def known(self) -> int:
        """How many versions it knows to be committed: listed, or fetched since."""
        return len(self._listed) + len(self._fetched)

    @property
    def _newest_listed(self) -> int:
        return max(self._listed, default=-1)

    async def _list(self) -> None:
        self._listed_at = self._clock()  # a failing listing is not retried by every request either
        self._listed = await asyncio.to_thread(self.store.versions)
        self._fetched = {v for v in self._fetched if v > self._newest_listed}  # the listing has the others


class AdapterSources:
    """Where a replica's adapters come from, by name: a bucket version of the fleet's own lineage from the
    fleet's bucket, a run's (`alice/policy-v3`) from the run's prefix of it and nowhere else, any other name
    from a PEFT folder under one of the trusted local folders (`fleet.extra_adapter_dirs`, where TRL's own
    trainer writes its adapters) or a committed version of a trusted other lineage (`fleet.extra_adapter_buckets`,
    a finished run's, say, loaded as a teacher). Also what is committed in each: `CommittedVersions` per prefix."""

    def __init__(
        self,
        url: str,
        bucket: BucketConfig,
        *,
        signing_secret: Secret,
        window: int,
        listing_interval_s: float = LISTING_INTERVAL_S,
        trusted_dirs: Iterable[str | Path] = (),
        cache_keep: int = 2,
        other_lineages: Iterable[str] = (),
    ):
        self.url, self.bucket, self.window, self.listing_interval_s = url, bucket, window, listing_interval_s
        self.signing_secret = signing_secret  # the fleet's: each lineage's versions must verify under its key
        self.trusted_dirs = [Path(d).expanduser().resolve() for d in trusted_dirs]
        self.cache_keep = cache_keep
        self.other_lineages = [prefix.rstrip("/") for prefix in other_lineages]  # `fleet.extra_adapter_buckets`
        self._prefixes: dict[tuple[str | None, str], tuple[AdapterStore, CommittedVersions]] = {}  # by (run, stem)
        self._others: dict[str, AdapterStore] = {}  # the other lineages fetched from (teachers'), pruned like the rest
        # (run, stem) of runs gone, whose cached folders are still to delete
        self._leaving: dict[tuple[str | None, str], AdapterStore] = {}
        self._tidying: asyncio.Task | None = None
        self._tidy_again = False
        self._retry: asyncio.TimerHandle | None = None  # the next try at the cached folders of runs gone
        self.store = self._prefix(None)[0]  # the fleet's own versions

    def _prefix(self, run: str | None, stem: str = POLICY_STEM) -> tuple[AdapterStore, CommittedVersions]:
        """The store of the fleet's own versions (`run` None), or of a run's, under its prefix of the bucket: of its
        policy lineage, or (`stem`) its ema lineage beside it, signed with the same key (the run's)."""
        lineage = (run, stem)
        if lineage not in self._prefixes:
            store = self._leaving.pop(lineage, None) or adapter_store(stem).at(
                run_prefix(self.url, run), self.bucket, lineage_key(self.signing_secret, run)
            )
            self._prefixes[lineage] = (store, CommittedVersions(store, self.window, self.listing_interval_s))
        return self._prefixes[lineage]

    def forget(self, run: str) -> None:
        """Run `run` left the fleet: forget its prefix (each of its lineages) and what is committed there; its cached
        folders go with the next `tidy` that finds none of them in use."""
        for stem in BUCKET_STEMS:
            entry = self._prefixes.pop((run, stem), None)
            if entry is not None:
                self._leaving[(run, stem)] = entry[0]

    def sizes(self) -> dict[str, int]:
        """Prefixes known, versions known over all of them, runs gone whose cached folders are still in use."""
        return {
            "run_prefixes": len({run for run, _ in self._prefixes}),
            "known_versions": sum(versions.known for _, versions in self._prefixes.values()),
            "leaving_runs": len({run for run, _ in self._leaving}),
        }

    async def cache_usage(self) -> tuple[int, int]:
        """(folders, bytes) in the disk cache of every prefix known and every run gone."""
        stores = [*(store for store, _ in self._prefixes.values()), *self._others.values(), *self._leaving.values()]
        usages = await asyncio.to_thread(lambda: [store.cache_usage() for store in stores])
        return sum(n for n, _ in usages), sum(b for _, b in usages)

    def tidy_soon(self) -> asyncio.Task:
        """Prune the disk cache in a worker thread (once more if asked again while it runs); the task doing it."""
        self._tidy_again = True
        if self._tidying is None or self._tidying.done():
            self._tidying = asyncio.get_running_loop().create_task(self._tidy_while_asked())
        return self._tidying

    async def tidy(self) -> None:
        """Prune the disk cache now, and wait for it."""
        await asyncio.shield(self.tidy_soon())

    async def _tidy_while_asked(self) -> None:
        while self._tidy_again:
            self._tidy_again = False
            kept = [*(store for store, _ in self._prefixes.values()), *self._others.values()]
            leaving = dict(self._leaving)
            try:
                gone = await asyncio.to_thread(_tidy, kept, leaving, self.cache_keep)
            except Exception as e:  # noqa: BLE001 - a disk that refuses: what is left is tried again next time
                log.warning("the adapter cache could not be pruned: %r", e)
                continue
            for run in gone:
                if self._leaving.get(run) is leaving[run]:  # not back meanwhile
                    del self._leaving[run]
        if self._leaving and self._retry is None:
            # A run gone whose folders a replica of the node still holds (requests draining, or the news not there
            # yet): tried again in a while, not only at this replica's next load.
            self._retry = asyncio.get_running_loop().call_later(LEAVING_RETRY_S, self._retry_leaving)

    def _retry_leaving(self) -> None:
        self._retry = None
        self.tidy_soon()

    async def to_serve(self, stem: str = POLICY_STEM) -> list[int]:
        """The fleet's own versions of lineage `stem` a replica serves from its start (listed afresh), oldest first."""
        return await self._prefix(None, stem)[1].to_serve()

    async def is_committed(self, ref: AdapterRef) -> bool:
        """Whether the bucket version `ref` is committed in its run's prefix (or the fleet's own)."""
        return await self._prefix(ref.run, ref.stem)[1].is_committed(ref.version)

    async def fetch(self, name: str, ref: str) -> tuple[str, HeldFolder]:
        """(source, verified local folder) of adapter `name` at `ref`: a bucket version, or a trusted local folder.
        A bucket version's folder is held in the cache until released (`HeldFolder.release`).

        A run's adapter (`alice/policy-v3`, `alice/ema-v3`) comes only from the run's own prefix of the bucket: its
        `lora_path` is resolved there (`adapters/policy-v3`, or that prefix's URL of it), never elsewhere."""
        run, local = split_run(name)
        ref_of_name = AdapterRef.parse(name)
        store, versions = self._prefix(run, ref_of_name.stem if ref_of_name else POLICY_STEM)
        try:
            version = store.resolve(ref)
        except InvalidName:
            if run is not None:
                raise BadRequest(
                    f"lora_path {redact(str(ref))[:300]!r}: run {run!r} loads only from {redact(store.url)}"
                ) from None
            other = self._other_lineage(name, ref)
            return await self._fetch(*other) if other else self._trusted_folder(name, ref)
        if local != store.key_of(version):
            raise BadRequest(f"lora_name {name!r} does not name the bucket version {store.key_of(version)}")
        source, folder = await self._fetch(store, version)
        versions.remember(version)
        return source, folder

    def _other_lineage(self, name: str, ref: str) -> tuple[AdapterStore, int] | None:
        """(store, version) of a committed version of another lineage the fleet trusts (`other_lineages`), which a
        name of its own that is no bucket version's (a teacher's) may load; else None."""
        found = split_version_url(ref) if isinstance(ref, str) and not AdapterRef.parse(name) else None
        if found is None or found[0].rstrip("/") not in self.other_lineages:
            return None
        prefix = found[0].rstrip("/")
        if prefix not in self._others:
            self._others[prefix] = AdapterStore.at(prefix, self.bucket)
        return self._others[prefix], found[1]

    async def _fetch(self, store: AdapterStore, version: int) -> tuple[str, HeldFolder]:
        """(URL, verified local folder) of committed `version` of `store`, its failures as the ingress answers them."""
        try:
            folder = await asyncio.to_thread(store.fetch_held, version)
            return store.url_of(version), folder
        except VersionNotFound:
            raise ModelNotFound(f"{store.key_of(version)} is not committed in the bucket") from None
        except NotSigned as e:  # planted in the lineage's prefix by another writer of the bucket
            raise ReplicaError(f"{store.key_of(version)} refused: {e}", 403) from None
        except IntegrityError as e:
            raise ReplicaError(f"{store.key_of(version)} failed verification: {e}", 502) from None
        except BucketError as e:
            raise ReplicaError(f"bucket unavailable: {e}", 503) from None

    def _trusted_folder(self, name: str, ref: str) -> tuple[str, HeldFolder]:
        """A PEFT folder under one of the trusted folders, for a name that is no bucket version's."""
        refused = BadRequest(f"lora_path {redact(str(ref))[:300]!r} is outside the bucket {redact(self.store.url)}")
        if not self.trusted_dirs or AdapterRef.parse(name) or not isinstance(ref, str):
            raise refused
        path = ref.removeprefix("file://")
        if not os.path.isabs(path):
            raise refused
        folder = Path(path).resolve()
        if not any(folder.is_relative_to(root) and folder != root for root in self.trusted_dirs):
            raise refused
        if not (folder / "adapter_config.json").is_file():
            raise ModelNotFound(f"no PEFT adapter at {folder}")
        return str(folder), HeldFolder(folder)  # not the cache's: never pruned, nothing to hold


def _tidy(kept: list[AdapterStore], leaving: dict, keep: int) -> list:
    """Prune the cache of each prefix in `kept` to the versions held plus the newest `keep`, delete what is not held
    of each lineage of a run in `leaving`; those of which nothing is left (blocking: a worker thread)."""
    for store in kept:
        store.prune_cache(keep)
    return [run for run, store in leaving.items() if store.drop_cache()]
