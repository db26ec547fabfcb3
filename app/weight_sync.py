"""Weight sync, in one place: how a new policy version reaches the bucket, the fleet and the rollout.

Every route that makes a replica serve a version goes through here, so that the rule is written
once: a version is served only once it is committed to the bucket, and a replica serves the newest
`max_staleness + 1` committed versions (older ones no sample may use any more).

- the learner (rank 0) publishes each version with `AdapterPublisher` (and, for an `ema` self teacher, the average
  of its versions under the same number with a second one, the run's `ema` lineage): commit to the bucket, signed with the
  lineage's key the fleet gave the run (`contracts.auth.lineage_key`; replicas load nothing else), drop
  versions past the retention window, ask the fleet to load it (through a Serve handle when the
  learner runs in the fleet's cluster: the learner's node cannot count on reaching the HTTP proxy;
  over HTTP with the run's token, as `<run>/policy-vN`, when the run joined a shared fleet);
- the driver makes sure the fleet serves the learner's version before sampling (`ensure_served`)
  and tells the rollout to sample with, and measure staleness to, a new version (`tell_rollout`);
- a replica that starts loads the newest committed versions, and one asked for a committed version it
  does not hold loads it from the bucket: that is the fleet's side (`deployments.replica.adapter_sources`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.fleet_client import fleet_admin_client
from contracts.adapters import POLICY_STEM, adapter_name
from contracts.auth import Secret
from core.bucket.filesystem import BucketError, VersionExists
from core.bucket.store import AdapterStore, adapter_store

log = logging.getLogger(__name__)

# How long rank 0 waits for the fleet to load a version. It publishes between collectives, and its
# peers wait for it in the next one for at most the process group's timeout (10 min,
# app/learner/model.py's COLLECTIVE_TIMEOUT), together with the bucket upload: far below that, and
# a version the fleet did not take within it reaches replicas from the bucket anyway.
FLEET_LOAD_DEADLINE_S = 60.0
# Version numbers in a row that a publish skips, taken by versions not of this lineage, before it gives up.
MAX_PLANTED = 8


def _load_on_fleet(fleet, store: AdapterStore, version: int, run: str | None) -> None:
    """Ask the fleet to load `version` of `store`'s lineage from the bucket; a run of a shared fleet names it by its
    path inside the run's prefix, which the fleet resolves in its own bucket (however this process reaches that
    bucket)."""
    if run:
        fleet.load_adapter(adapter_name(version, run, store.stem), store.key_of(version))
    else:
        fleet.load_adapter(store.key_of(version), store.url_of(version))


class AdapterPublisher:
    """The learner's side: commit a version to the bucket, then ask the fleet (if any) to load it.

    `fleet_url` is `deployments.fleet.cluster_address` inside the fleet's Ray cluster, or an HTTP
    URL. A failed fleet load is logged and counted, not raised: the version is in the bucket, where
    replicas that (re)start pick it up, and the next sync tries a newer one. Nor is it waited for
    past `fleet_deadline_s`: the call runs on a thread of its own, where one that hangs finishes
    (bounded by the client's timeout) while rank 0 goes back to its peers.
    """

    def __init__(
        self,
        cfg,
        fleet_url: str | None = None,
        fleet_token: str | None = None,
        *,
        signing_key: Secret | None = None,
        fleet_deadline_s: float = FLEET_LOAD_DEADLINE_S,
        stem: str = POLICY_STEM,
    ):
        self.store = adapter_store(stem).from_config(cfg, signing_key)  # the run's policy lineage, or its ema
        self.stem = stem
        self.run = cfg.fleet_run
        self.keep_versions = cfg.bucket.keep_versions
        self.fleet_url, self._fleet_token = fleet_url, fleet_token
        self.fleet_deadline_s = fleet_deadline_s
        self._fleet = None
        # One thread: fleet calls never overlap, and one still queued behind a hung call is cancelled unsent.
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-load")
        self.fleet_load_failures = 0

    def latest(self) -> int | None:
        """The newest committed version (another learner's lineage included)."""
        return self.store.latest()

    def publish(self, adapter_dir: Path, version: int) -> int:
        """Commit `adapter_dir` as `version`, or as the next number free of versions planted in this lineage's
        prefix by another writer of the bucket (not signed with our key: the fleet refuses them, and ours must not
        be refused for a number they took); the version committed."""
        for _ in range(MAX_PLANTED):
            try:
                self.store.publish(adapter_dir, version)
                break
            except VersionExists:
                if self.store.signing_key is None or self.store.signed(version):
                    raise  # our own lineage's: a second learner of this run
                log.warning(
                    "%s in this run's prefix is not signed with its key (written by another writer of the bucket): "
                    "publishing as %s instead",
                    adapter_name(version, self.run, self.stem),
                    adapter_name(version + 1, self.run, self.stem),
                )
                version += 1
        else:
            raise BucketError(f"publish: {MAX_PLANTED} versions in a row in this run's prefix are not its own")
        self.store.gc(self.keep_versions)
        if self.fleet_url:
            self._tell_fleet(version)
        return version

    def _tell_fleet(self, version: int) -> None:
        call = self._calls.submit(self._load, version)
        try:
            call.result(timeout=self.fleet_deadline_s)
        except Exception as exc:  # noqa: BLE001 - any fleet error must not kill training
            call.cancel()  # still queued behind an earlier call: never sent
            self.fleet_load_failures += 1
            reason = str(exc) if str(exc) else f"{type(exc).__name__} after {self.fleet_deadline_s:.0f} s"
            log.warning("fleet did not load %s: %s", adapter_name(version, self.run, self.stem), reason)

    def _load(self, version: int) -> None:
        if self._fleet is None:
            self._fleet = fleet_admin_client(self.fleet_url, self._fleet_token, self.fleet_deadline_s)
        _load_on_fleet(self._fleet, self.store, version, self.run)

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        if self._fleet is not None:
            self._fleet.close()


def ensure_served(fleet, cfg, version: int) -> None:
    """Make sure the fleet serves `version` before sampling from it, or fail.

    The learner only counts a failed load (training goes on); at start-up there is no point going
    on without the learner's version, so load it here and let an error end the run.
    """
    name = adapter_name(version, cfg.fleet_run)
    if name not in {m["id"] for m in fleet.models()}:
        log.info("the fleet does not serve %s yet: loading it from the bucket", name)
        _load_on_fleet(fleet, AdapterStore.from_config(cfg), version, cfg.fleet_run)


def tell_rollout(rollout, version: int) -> None:
    """The rollout actor samples with `version` from now on and measures staleness to it."""
    import ray

    ray.get(rollout.set_policy_version.remote(version))
