"""Weight sync's rules: which committed versions a replica serves, how rarely it lists the bucket to find out,
and loading the learner's version at start-up."""

import asyncio
import threading
import time

from app.bucket.store import AdapterStore
from app.config import load_config
from app.weight_sync import CommittedVersions, ensure_served


def _config(tmp_path, *overrides: str):
    return load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache", *overrides])


def _publish(store: AdapterStore, tmp_path, *versions: int) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text('{"r": 1}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    for v in versions:
        store.publish(adapter, v)


def test_a_replica_serves_the_newest_committed_versions_oldest_first(tmp_path):
    store = AdapterStore.from_config(_config(tmp_path))

    def versions_to_serve():
        return asyncio.run(CommittedVersions(store, window=3).to_serve())

    def is_committed(version):
        return asyncio.run(CommittedVersions(store, window=3).is_committed(version))

    assert versions_to_serve() == []
    _publish(store, tmp_path, 0, 1, 2, 3, 4)
    assert versions_to_serve() == [2, 3, 4]
    assert is_committed(4) and is_committed(2)
    assert is_committed(1)  # too old for a sample, but committed: served on demand (an evaluation, say)
    assert not is_committed(5)


class _Bucket:
    """Committed versions, newest first, counting the listings; each listing takes `delay_s`."""

    def __init__(self, *committed: int, delay_s: float = 0.0):
        self.committed, self.delay_s, self.listings = list(committed), delay_s, 0
        self._count = threading.Lock()  # listings run on threads

    def versions(self) -> list[int]:
        with self._count:
            self.listings += 1
        time.sleep(self.delay_s)
        return list(self.committed)


async def _ask(versions: CommittedVersions, *asked: int) -> list[bool]:
    """The answers to requests for `asked`, all at once (a replica's one event loop)."""
    return await asyncio.gather(*(versions.is_committed(v) for v in asked))


def test_a_burst_of_requests_for_unknown_versions_lists_the_bucket_once_per_interval():
    now = [0.0]
    bucket = _Bucket(3, 2, 1, 0, delay_s=0.05)
    versions = CommittedVersions(bucket, window=3, min_interval_s=5.0, clock=lambda: now[0])

    async def scenario():
        assert await versions.to_serve() == [1, 2, 3] and bucket.listings == 1  # start-up
        assert await _ask(versions, 3, 2, 1, 0) == [True, True, True, True]  # known: no listing
        assert bucket.listings == 1
        assert not any(await _ask(versions, *range(4, 1004)))  # 1000 versions nobody published
        assert bucket.listings == 1  # listed at start-up, less than the interval ago
        now[0] = 5.0
        assert not any(await _ask(versions, *range(4, 1004)))
        assert bucket.listings == 2  # one listing, shared by the burst
        bucket.committed.insert(0, 4)
        assert await _ask(versions, 4) == [False]  # published within the interval: found by the next listing
        now[0] = 10.0
        assert await _ask(versions, 4, 4, 4) == [True, True, True]
        assert await _ask(versions, 1) == [True]  # out of the window since v4, still committed
        assert bucket.listings == 3

    asyncio.run(scenario())


def test_an_older_unknown_version_is_refused_without_listing():
    bucket = _Bucket(9, 7, 6)  # v8 was never committed (or was removed)
    versions = CommittedVersions(bucket, window=3, min_interval_s=0.0)

    async def scenario():
        await versions.to_serve()
        assert await _ask(versions, 8, 5, 0, 8) == [False] * 4
        assert bucket.listings == 1  # however often: nothing older than v9 is going to appear

    asyncio.run(scenario())


def test_requests_waiting_for_a_listing_share_it():
    bucket = _Bucket(2, 1, delay_s=0.2)
    versions = CommittedVersions(bucket, window=2, min_interval_s=0.0)  # no interval: sharing alone

    async def scenario():
        await versions.to_serve()
        bucket.committed.insert(0, 3)  # published, its broadcast missed
        assert all(await _ask(versions, *[3] * 200))
        assert bucket.listings == 2

    asyncio.run(scenario())


def test_versions_fetched_by_broadcast_count_as_known():
    bucket = _Bucket(5, 4, 3)
    versions = CommittedVersions(bucket, window=3, min_interval_s=0.0)

    async def scenario():
        await versions.to_serve()
        bucket.committed[:0] = [8, 7, 6]
        versions.remember(6)  # came by broadcast since the listing (and was evicted since, say)
        versions.remember(7)
        assert await _ask(versions, 6, 7, 4) == [True, True, True] and bucket.listings == 1
        # Newer than the listing and never fetched here (its broadcast was missed): listed for.
        assert await _ask(versions, 8) == [True] and bucket.listings == 2

    asyncio.run(scenario())


class _Fleet:
    def __init__(self, served: list[str]):
        self.served, self.loads = served, []

    def models(self):
        return [{"id": "base", "parent": None}, *({"id": name, "parent": "base"} for name in self.served)]

    def load_adapter(self, name, path):
        self.loads.append((name, path))


def test_the_driver_loads_the_learners_version_only_when_the_fleet_lacks_it(tmp_path):
    cfg = _config(tmp_path)
    store = AdapterStore.from_config(cfg)
    _publish(store, tmp_path, 0, 1)
    fleet = _Fleet(["policy-v1"])
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == []
    fleet = _Fleet(["policy-v0"])
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == [("policy-v1", store.url_of(1))]


def test_a_run_of_a_shared_fleet_names_its_versions_by_run_and_their_paths_inside_its_prefix(tmp_path):
    """Joined with `--fleet`, the run's adapters are `<run>/policy-vN`, loaded from `policy-vN`: the fleet
    resolves that in the run's prefix of its own bucket, however this process reaches the bucket."""
    cfg = _config(tmp_path, "fleet.join_url=http://127.0.0.1:8000", "logging.run_name=alice")
    _publish(AdapterStore.from_config(cfg), tmp_path, 0, 1)
    fleet = _Fleet(["policy-v1", "bob/policy-v1"])  # somebody else's versions are not this run's
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == [("alice/policy-v1", "policy-v1")]
    ensure_served(_Fleet(["alice/policy-v1"]), cfg, 1)


class _HungFleet:
    """A fleet whose loads block until `release` is set (a broadcast stuck on a replica, a fleet that never answers)."""

    def __init__(self):
        import threading

        self.release, self.loads = threading.Event(), []

    def load_adapter(self, name, path):
        self.loads.append(name)
        self.release.wait(30)

    def close(self):
        self.release.set()


def test_rank0_waits_for_the_fleet_no_longer_than_the_deadline_and_goes_on(tmp_path, monkeypatch):
    """Rank 0's peers wait for it in a collective: a fleet that hangs must not hold it near that timeout."""
    import time

    import app.weight_sync as weight_sync
    from app.weight_sync import FLEET_LOAD_DEADLINE_S, AdapterPublisher

    assert FLEET_LOAD_DEADLINE_S <= 60  # a tenth of the learner's 10 min collective timeout at most
    fleet = _HungFleet()
    monkeypatch.setattr(weight_sync, "fleet_admin_client", lambda address, token, timeout_s: fleet)
    publisher = AdapterPublisher(_config(tmp_path), "serve://spotrl", fleet_deadline_s=0.3)
    _publish(publisher.store, tmp_path)  # writes the adapter folder
    adapter = tmp_path / "adapter"
    try:
        for version in (0, 1):
            t0 = time.monotonic()
            publisher.publish(adapter, version)
            assert time.monotonic() - t0 < 2.0
            assert publisher.store.latest() == version  # committed all the same: replicas find it in the bucket
        assert publisher.fleet_load_failures == 2
        assert fleet.loads == ["policy-v0"]  # v1 waited behind the hung call and was dropped unsent
        fleet.release.set()
        time.sleep(0.1)  # the hung call returns
        publisher.publish(adapter, 2)
        assert fleet.loads == ["policy-v0", "policy-v2"] and publisher.fleet_load_failures == 2
    finally:
        publisher.close()


def test_inside_the_cluster_the_fleet_is_reached_by_serve_handle_elsewhere_by_http(monkeypatch):
    from ray import serve

    from app.fleet_client import FleetClient
    from app.weight_sync import fleet_admin_client
    from deployments.fleet import ServeFleet, cluster_address

    http = fleet_admin_client("http://127.0.0.1:8000", "secret", 5.0)
    assert isinstance(http, FleetClient) and http.base_url == "http://127.0.0.1:8000"
    http.close()

    calls = []

    class _Response:
        def __init__(self, args):
            self.args = args

        def result(self, timeout_s=None):
            calls.append((self.args, timeout_s))
            return {"status": "ok", "replicas": 1}

    class _Ingress:
        class load_adapter:  # noqa: N801 - stands in for a handle's method attribute
            @staticmethod
            def remote(*args):
                return _Response(args)

    apps = []
    monkeypatch.setattr(serve, "get_app_handle", lambda name: apps.append(name) or _Ingress())
    address = cluster_address(_config_with_app("myapp"))
    assert address == "serve://myapp"
    fleet = fleet_admin_client(address, "ignored", 7.0)
    assert isinstance(fleet, ServeFleet)
    assert fleet.load_adapter("policy-v3", "s3://b/adapters/policy-v3") == {"status": "ok", "replicas": 1}
    fleet.load_adapter("policy-v4", "s3://b/adapters/policy-v4")
    assert apps == ["myapp"]  # one handle, looked up once
    assert calls == [
        (("policy-v3", "s3://b/adapters/policy-v3"), 7.0),
        (("policy-v4", "s3://b/adapters/policy-v4"), 7.0),
    ]


def _config_with_app(app_name: str):
    return load_config(None, [f"fleet.app_name={app_name}"])
