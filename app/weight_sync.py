"""Weight sync, in one place: how a new policy version reaches the bucket, the fleet and the rollout.

Every route that makes a replica serve a version goes through here, so that the rule is written
once: a version is served only once it is committed to the bucket, and a replica serves the newest
`max_staleness + 1` committed versions (older ones no sample may use any more).

- the learner (rank 0) publishes each version with `AdapterPublisher`: commit to the bucket, drop
  versions past the retention window, ask the fleet to load it;
- the driver makes sure the fleet serves the learner's version before sampling (`ensure_served`)
  and tells the rollout to sample with, and measure staleness to, a new version (`tell_rollout`);
- a replica that starts loads `versions_to_serve`, and one asked for a version it does not hold
  loads it if `should_serve` says so (published while it was starting, or a missed broadcast).
"""

from __future__ import annotations

import logging
from pathlib import Path

from app.bucket.store import AdapterStore
from app.messages import adapter_name

log = logging.getLogger(__name__)


def versions_to_serve(store: AdapterStore, window: int) -> list[int]:
    """The committed versions a replica should serve, oldest first (so an engine's LRU order matches age)."""
    return sorted(store.versions()[:window])


def should_serve(store: AdapterStore, version: int, window: int) -> bool:
    """Whether a replica should load `version` on demand: it is one of the versions the fleet serves."""
    return version in versions_to_serve(store, window)


def _load_on_fleet(fleet, store: AdapterStore, version: int) -> None:
    fleet.load_adapter(adapter_name(version), store.url_of(version))


class AdapterPublisher:
    """The learner's side: commit a version to the bucket, then ask the fleet (if any) to load it.

    A failed fleet load is logged and counted, not raised: the version is in the bucket, where
    replicas that (re)start pick it up, and the next sync tries a newer one.
    """

    def __init__(self, cfg, fleet_url: str | None = None, fleet_token: str | None = None):
        self.store = AdapterStore.from_config(cfg)
        self.keep_versions = cfg.bucket.keep_versions
        self.fleet_url, self._fleet_token = fleet_url, fleet_token
        self._fleet = None
        self.fleet_load_failures = 0

    def latest(self) -> int | None:
        """The newest committed version (another learner's lineage included)."""
        return self.store.latest()

    def publish(self, adapter_dir: Path, version: int) -> None:
        self.store.publish(adapter_dir, version)
        self.store.gc(self.keep_versions)
        if self.fleet_url:
            self._tell_fleet(version)

    def _tell_fleet(self, version: int) -> None:
        from app.fleet_client import FleetClient

        if self._fleet is None:
            self._fleet = FleetClient(self.fleet_url, token=self._fleet_token)
        try:
            _load_on_fleet(self._fleet, self.store, version)
        except Exception as exc:  # noqa: BLE001 - any fleet error must not kill training
            self.fleet_load_failures += 1
            log.warning("fleet did not load %s: %s", adapter_name(version), exc)

    def close(self) -> None:
        if self._fleet is not None:
            self._fleet.close()


def ensure_served(fleet, cfg, version: int) -> None:
    """Make sure the fleet serves `version` before sampling from it, or fail.

    The learner only counts a failed load (training goes on); at start-up there is no point going
    on without the learner's version, so load it here and let an error end the run.
    """
    name = adapter_name(version)
    if name not in {m["id"] for m in fleet.models()}:
        log.info("the fleet does not serve %s yet: loading it from the bucket", name)
        _load_on_fleet(fleet, AdapterStore.from_config(cfg), version)


def tell_rollout(rollout, version: int) -> None:
    """The rollout actor samples with `version` from now on and measures staleness to it."""
    import ray

    ray.get(rollout.set_policy_version.remote(version))
