"""Weight sync's rules: which committed versions a replica serves, and loading the learner's version at start-up."""

from app.bucket.store import AdapterStore
from app.config import load_config
from app.weight_sync import ensure_served, should_serve, versions_to_serve


def _config(tmp_path):
    return load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])


def _publish(store: AdapterStore, tmp_path, *versions: int) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text('{"r": 1}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    for v in versions:
        store.publish(adapter, v)


def test_a_replica_serves_the_newest_committed_versions_oldest_first(tmp_path):
    store = AdapterStore.from_config(_config(tmp_path))
    assert versions_to_serve(store, window=3) == []
    _publish(store, tmp_path, 0, 1, 2, 3, 4)
    assert versions_to_serve(store, window=3) == [2, 3, 4]
    assert should_serve(store, 4, window=3) and should_serve(store, 2, window=3)
    assert not should_serve(store, 1, window=3)  # too old for any sample
    assert not should_serve(store, 5, window=3)  # not committed


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
