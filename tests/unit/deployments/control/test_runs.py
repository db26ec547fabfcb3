"""The registry of a shared fleet's runs (`deployments.control.runs`): only each token's sha256 kept, and a run
refused when the pinned windows of every run would no longer fit the LoRA slots."""

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings, register


def test_registration_is_refused_when_the_pinned_sets_no_longer_fit_the_slots(fleet):
    _, client = fleet
    register(client, "alice")
    register(client, "bob")  # the fleet's own lineage + 2 runs, 2 versions each, 1 to load into: 7 slots
    r = client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN)
    assert r.status_code == 409
    assert "fleet.max_loras=7" in r.json()["error"]["message"] and "9 LoRA slots" in r.json()["error"]["message"]
    client.delete("/v1/runs/bob", headers=ADMIN)
    register(client, "carol")  # room again


def test_the_registry_keeps_only_the_tokens_sha256():
    from deployments.control.runs import Runs

    runs = Runs(max_loras=7, max_staleness=1)
    token = runs.register("alice")
    assert runs.run_of(token) == "alice" and runs.run_of(token + "x") is None
    assert token not in repr(runs) and token not in repr(vars(runs))


def test_a_run_registers_with_its_own_window_and_rank_and_the_fleet_checks_both():
    """Slots are pinned per run by the window it states (max_staleness + 1); a rank above the engines' is a 400."""
    client = TestClient(make_app(FakeBackend(), api_settings(max_loras=9, max_staleness=1, max_lora_rank=8)))
    r = client.post("/v1/runs", json={"name": "alice", "max_staleness": 3, "lora_rank": 8}, headers=ADMIN)
    assert r.status_code == 200 and (r.json()["max_staleness"], r.json()["lora_rank"]) == (3, 8)
    r = client.post("/v1/runs", json={"name": "bob", "lora_rank": 16}, headers=ADMIN)
    assert r.status_code == 400 and "lora_rank: 16 exceeds the fleet's max_lora_rank 8" in r.json()["error"]["message"]
    # alice 4 + the fleet's own lineage 2 + one to load into = 7 of 9: a run of window 2 fits, one of window 3 not.
    r = client.post("/v1/runs", json={"name": "bob", "max_staleness": 2}, headers=ADMIN)
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    assert "alice 4, bob 3" in message and "own lineage 2" in message and "10 LoRA slots" in message, message
    assert "fleet.max_loras=9" in message
    r = client.post("/v1/runs", json={"name": "bob"}, headers=ADMIN)  # the fleet's max_staleness: window 2
    assert r.status_code == 200 and r.json()["max_staleness"] == 1
    assert client.get("/v1/runs/bob", headers=ADMIN).json()["max_staleness"] == 1


def test_a_run_with_an_ema_average_pins_a_window_per_lineage_and_says_so_when_it_does_not_fit():
    """A self-distilling run whose learner publishes `ema-vN` beside `policy-vN` registers two lineages: both
    windows count against the slots, so its versions and another run's do not evict each other."""
    client = TestClient(make_app(FakeBackend(), api_settings(max_loras=9, max_staleness=1)))
    r = client.post("/v1/runs", json={"name": "alice", "lineages": 2}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["lineages"] == 2
    assert client.get("/v1/runs/alice", headers=ADMIN).json()["lineages"] == 2
    # alice 2 x 2 + the fleet's own lineage 2 + one to load into = 7 of 9: a one-lineage run of window 2 fits ...
    r = client.post("/v1/runs", json={"name": "bob", "lineages": 2}, headers=ADMIN)
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    assert "alice 2 x 2 lineages, bob 2 x 2 lineages" in message and "11 LoRA slots" in message, message
    r = client.post("/v1/runs", json={"name": "bob", "lineages": 3}, headers=ADMIN)
    assert r.status_code == 400 and "lineages" in r.json()["error"]["message"]
    r = client.post("/v1/runs", json={"name": "bob"}, headers=ADMIN)  # ... and says it has one
    assert r.status_code == 200 and r.json()["lineages"] == 1


def test_a_registration_recorded_before_runs_stated_lineages_is_read_as_one():
    from deployments.control.runs import Registration

    old = {"token_sha256": "ab", "weight": None, "max_staleness": 1, "lora_rank": 8}  # a record of the last release
    assert Registration.from_record(old).lineages is None
    assert Registration.from_record(Registration("ab", lineages=2).as_record()).lineages == 2


def test_the_shipped_fleet_hosts_two_runs_as_shipped_and_refuses_a_third_as_a_conflict_with_the_arithmetic(tmp_path):
    """`make serve` (serve_config.yaml's fleet) then docs/shared-fleet.md's `POST /v1/runs {"name": ...}` twice: both
    fit, since the fleet's own `policy-vN` lineage pins no slot while nothing of it is committed. Once a version of it
    is, it pins its window like any lineage."""

    import yaml

    from core.bucket.store import AdapterStore
    from core.config import load_fleet_config
    from tests.support import REPO as repo

    (app,) = yaml.safe_load((repo / "serve_config.yaml").read_text())["applications"]
    url = f"file://{tmp_path}/bucket"
    cfg = load_fleet_config(repo / app["args"]["config"], [*app["args"]["overrides"], f"bucket.url={url}"])
    own = AdapterStore.at(cfg.bucket_url, cfg.bucket)
    settings = api_settings(max_loras=cfg.max_loras, max_staleness=cfg.max_staleness, max_lora_rank=cfg.max_lora_rank)
    client = TestClient(make_app(FakeBackend(), settings, own_lineage=lambda: own.latest() is not None))

    register(client, "alice")
    register(client, "bob")  # 3 + 3 + 1 to load into = 7 of 8 slots
    r = client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict"
    message = r.json()["error"]["message"]
    assert "alice 3, bob 3, carol 3" in message and "own lineage none" in message, message
    assert "10 LoRA slots" in message and "fleet.max_loras=8" in message, message

    adapter = tmp_path / "adapter"  # the fleet's own learner publishes policy-v0: its lineage pins 3 from now on
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 1}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    own.publish(adapter, 0)
    assert client.delete("/v1/runs/bob", headers=ADMIN).status_code == 200
    r = client.post("/v1/runs", json={"name": "bob"}, headers=ADMIN)
    assert r.status_code == 409 and "own lineage 3" in r.json()["error"]["message"], r.json()
    assert client.post("/v1/runs", json={"name": "bob", "max_staleness": 0}, headers=ADMIN).status_code == 200
