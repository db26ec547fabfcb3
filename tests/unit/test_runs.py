"""The registry of a shared fleet's runs (`deployments.control.runs`): only each token's sha256 kept, and a run
refused when the pinned windows of every run would no longer fit the LoRA slots."""

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.unit.fake_fleet import ADMIN, FakeBackend, api_settings, register


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
