"""Where a replica's adapters come from: the fleet's bucket (a run's prefix of it, for a run's adapters), and
which committed versions there are to serve.

A replica that starts loads `CommittedVersions.to_serve()` (the newest `max_staleness + 1`), and one asked
for a version it does not hold loads it if `CommittedVersions.is_committed` says so (published while it was
starting, a missed broadcast, or evicted from its LoRA slot: a committed version is never a 404).
`CommittedVersions` asks the bucket on the replica's behalf, sparingly: a request for a version the
replica does not know must not become a bucket listing each (fees, throttling that would hit the
learner's publishes too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from app.bucket.store import AdapterStore

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
