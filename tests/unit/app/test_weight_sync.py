"""Weight sync: loading the learner's version at start-up, naming a run's versions, and not waiting on a hung fleet."""

import threading
import time

from app.weight_sync import ensure_served
from core.bucket.store import AdapterStore
from tests.support.replica_parts import local_config, publish


class _Fleet:
    def __init__(self, served: list[str]):
        self.served, self.loads = served, []

    def models(self):
        return [{"id": "base", "parent": None}, *({"id": name, "parent": "base"} for name in self.served)]

    def load_adapter(self, name, path):
        self.loads.append((name, path))


def test_the_driver_loads_the_learners_version_only_when_the_fleet_lacks_it(tmp_path):
    cfg = local_config(tmp_path)
    store = AdapterStore.from_config(cfg)
    publish(store, tmp_path, 0, 1)
    fleet = _Fleet(["policy-v1"])
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == []
    fleet = _Fleet(["policy-v0"])
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == [("policy-v1", store.url_of(1))]


def test_a_run_of_a_shared_fleet_names_its_versions_by_run_and_their_paths_inside_its_prefix(tmp_path):
    """Joined with `--fleet`, the run's adapters are `<run>/policy-vN`, loaded from `policy-vN`: the fleet
    resolves that in the run's prefix of its own bucket, however this process reaches the bucket."""
    cfg = local_config(tmp_path, "join.url=http://127.0.0.1:8000", "logging.run_name=alice")
    publish(AdapterStore.from_config(cfg), tmp_path, 0, 1)
    fleet = _Fleet(["policy-v1", "bob/policy-v1"])  # somebody else's versions are not this run's
    ensure_served(fleet, cfg, 1)
    assert fleet.loads == [("alice/policy-v1", "policy-v1")]
    ensure_served(_Fleet(["alice/policy-v1"]), cfg, 1)


class _HungFleet:
    """A fleet whose loads block until `release` is set (a broadcast stuck on a replica, a fleet that never answers)."""

    def __init__(self):

        self.release, self.loads = threading.Event(), []

    def load_adapter(self, name, path):
        self.loads.append(name)
        self.release.wait(30)

    def close(self):
        self.release.set()


def test_rank0_waits_for_the_fleet_no_longer_than_the_deadline_and_goes_on(tmp_path, monkeypatch):
    """Rank 0's peers wait for it in a collective: a fleet that hangs must not hold it near that timeout."""

    import app.weight_sync as weight_sync
    from app.weight_sync import FLEET_LOAD_DEADLINE_S, AdapterPublisher

    assert FLEET_LOAD_DEADLINE_S <= 60  # a tenth of the learner's 10 min collective timeout at most
    fleet = _HungFleet()
    monkeypatch.setattr(weight_sync, "fleet_admin_client", lambda address, token, timeout_s: fleet)
    publisher = AdapterPublisher(local_config(tmp_path), "serve://spotrl", fleet_deadline_s=0.3)
    publish(publisher.store, tmp_path)  # writes the adapter folder
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

    from app.fleet_client import FleetClient, ServeFleet, fleet_admin_client
    from contracts.serving import serve_address

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
    address = serve_address("myapp")
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


def test_a_learner_publishes_past_a_version_planted_in_its_prefix_and_fails_on_its_own(tmp_path):
    """Another writer of the bucket took this run's next version number: the learner publishes its version as the
    next free one (the fleet refuses the planted one), and says what it published; a version of its own lineage at
    that number is a second learner of the run, an error as before."""
    import pytest

    from app.weight_sync import AdapterPublisher
    from contracts.auth import lineage_key, signing_secret
    from core.bucket.filesystem import VersionExists
    from tests.support.replica_parts import adapter_folder

    cfg = local_config(tmp_path)
    key = lineage_key(signing_secret("token-of-this-fleet"), None)
    publisher = AdapterPublisher(cfg, signing_key=key)
    folder = adapter_folder(tmp_path / "mine", b"mine")
    assert publisher.publish(folder, 1) == 1
    publish(AdapterStore.from_config(cfg), tmp_path, 2)  # planted, unsigned
    assert publisher.publish(folder, 2) == 3
    assert publisher.store.signed(3) and not publisher.store.signed(2)
    with pytest.raises(VersionExists):
        publisher.publish(folder, 3)
    publisher.close()
