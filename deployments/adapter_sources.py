"""Where a replica's adapters come from: the fleet's bucket (a run's prefix of it, for a run's adapters) or a
trusted local folder, and which committed versions there are to serve.

A replica that starts loads `AdapterSources.to_serve()` (the newest `max_staleness + 1`), and one asked
for a version it does not hold loads it if `AdapterSources.is_committed` says so (published while it was
starting, a missed broadcast, or evicted from its LoRA slot: a committed version is never a 404).
`CommittedVersions` asks the bucket on the replica's behalf, sparingly: a request for a version the
replica does not know must not become a bucket listing each (fees, throttling that would hit the
learner's publishes too). What a fetch fails with is what the ingress answers: a reference outside the
bucket is a 400, a version never committed a 404, a corrupted one a 502, a bucket out of reach a 503.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from app.bucket.filesystem import BucketError, IntegrityError, InvalidName, VersionNotFound
from app.bucket.store import AdapterStore
from app.config import BucketConfig
from contracts.adapters import AdapterRef, adapter_name, run_prefix, split_run, split_version_url
from contracts.auth import redact
from contracts.serving import BadRequest, ModelNotFound, ReplicaError

# How often a replica may list the bucket for versions newer than the newest it knows.
LISTING_INTERVAL_S = 5.0


def newest(versions: Iterable[int], window: int) -> list[int]:
    """The newest `window` of `versions`, oldest first (so an engine's LRU order matches age)."""
    return sorted(set(versions))[-window:] if window > 0 else []


class CommittedVersions:
    """A replica's knowledge of the committed versions: the bucket's last listing, and the versions it fetched.

    Versions are committed in increasing order, so a version older than the newest listed that the
    listing lacks is not going to appear: it is refused without asking the bucket. Only a version
    newer than the newest listed makes the replica list again, at most once every `min_interval_s`,
    and requests that arrive while a listing runs wait for it and share it. Within the interval a
    version still unknown is refused (404): a flood of requests for versions nobody published
    must neither list the bucket nor wait, and a missed version a client asks for again is found
    by the next listing.
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
        """The versions a replica should serve now (listed afresh: at start-up), oldest first."""
        async with self._lock:
            await self._list()
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

    @property
    def _newest_listed(self) -> int:
        return max(self._listed, default=-1)

    async def _list(self) -> None:
        self._listed_at = self._clock()  # a failing listing is not retried by every request either
        self._listed = await asyncio.to_thread(self.store.versions)


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
        window: int,
        listing_interval_s: float = LISTING_INTERVAL_S,
        trusted_dirs: Iterable[str | Path] = (),
        other_lineages: Iterable[str] = (),
    ):
        self.url, self.bucket, self.window, self.listing_interval_s = url, bucket, window, listing_interval_s
        self.trusted_dirs = [Path(d).expanduser().resolve() for d in trusted_dirs]
        self.other_lineages = [prefix.rstrip("/") for prefix in other_lineages]  # `fleet.extra_adapter_buckets`
        self._prefixes: dict[str | None, tuple[AdapterStore, CommittedVersions]] = {}
        self.store = self._prefix(None)[0]  # the fleet's own versions

    def _prefix(self, run: str | None) -> tuple[AdapterStore, CommittedVersions]:
        """The store of the fleet's own versions (`run` None), or of a run's, under its prefix of the bucket."""
        if run not in self._prefixes:
            store = AdapterStore.at(run_prefix(self.url, run), self.bucket)
            self._prefixes[run] = (store, CommittedVersions(store, self.window, self.listing_interval_s))
        return self._prefixes[run]

    async def to_serve(self) -> list[int]:
        """The fleet's own versions a replica serves from its start (listed afresh), oldest first."""
        return await self._prefix(None)[1].to_serve()

    async def is_committed(self, ref: AdapterRef) -> bool:
        """Whether the bucket version `ref` is committed in its run's prefix (or the fleet's own)."""
        return await self._prefix(ref.run)[1].is_committed(ref.version)

    async def fetch(self, name: str, ref: str) -> tuple[str, Path]:
        """(source, verified local folder) of adapter `name` at `ref`: a bucket version, or a trusted local folder.

        A run's adapter (`alice/policy-v3`) comes only from the run's own prefix of the bucket: its
        `lora_path` is resolved there (`adapters/policy-v3`, or that prefix's URL of it), never elsewhere."""
        run, local = split_run(name)
        store, versions = self._prefix(run)
        try:
            version = store.resolve(ref)
        except InvalidName:
            if run is not None:
                raise BadRequest(
                    f"lora_path {redact(str(ref))[:300]!r}: run {run!r} loads only from {redact(store.url)}"
                ) from None
            other = self._other_lineage(name, ref)
            return await self._fetch(*other) if other else self._trusted_folder(name, ref)
        if local != adapter_name(version):
            raise BadRequest(f"lora_name {name!r} does not name the bucket version {adapter_name(version)}")
        source, folder = await self._fetch(store, version)
        versions.remember(version)
        return source, folder

    def _other_lineage(self, name: str, ref: str) -> tuple[AdapterStore, int] | None:
        """(store, version) of a committed version of another lineage the fleet trusts (`other_lineages`), which a
        name of its own that is no bucket version's (a teacher's) may load; else None."""
        found = split_version_url(ref) if isinstance(ref, str) and not AdapterRef.parse(name) else None
        if found is None or found[0].rstrip("/") not in self.other_lineages:
            return None
        return AdapterStore.at(found[0], self.bucket), found[1]

    async def _fetch(self, store: AdapterStore, version: int) -> tuple[str, Path]:
        """(URL, verified local folder) of committed `version` of `store`, its failures as the ingress answers them."""
        try:
            folder = await asyncio.to_thread(store.fetch, version)
            return store.url_of(version), folder
        except VersionNotFound:
            raise ModelNotFound(f"{adapter_name(version)} is not committed in the bucket") from None
        except IntegrityError as e:
            raise ReplicaError(f"{adapter_name(version)} failed verification: {e}", 502) from None
        except BucketError as e:
            raise ReplicaError(f"bucket unavailable: {e}", 503) from None

    def _trusted_folder(self, name: str, ref: str) -> tuple[str, Path]:
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
        return str(folder), folder
