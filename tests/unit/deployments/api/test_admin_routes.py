"""vLLM's admin calls (`deployments.api.admin_routes`) over a fake backend: applied to every replica or to none,
a failed load rolled back and the fleet resumed."""

from contracts.control import UndoLoad
from tests.support.fake_fleet import TOKEN


def test_malformed_admin_bodies_get_400_after_auth(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=auth).status_code == 400
    json_auth = {**auth, "Content-Type": "application/json"}
    assert client.post("/v1/load_lora_adapter", content=b"nope", headers=json_auth).status_code == 400
    r = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "p", "load_inplace": True}, headers=auth
    )
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    assert client.post("/pause", params={"mode": "later"}, headers=auth).status_code == 400


def test_a_load_that_fails_anywhere_is_rolled_back_everywhere(client, backend):
    backend.fail_load_on = {1}
    body = {"lora_name": "policy-v1", "lora_path": "/etc/passwd"}
    r = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "outside the bucket" in r.json()["error"]["message"]
    load_id = [c for c in backend.calls if c[0] == "LoadAdapter"][-1][1].load_id
    assert ("UndoLoad", UndoLoad("policy-v1", load_id)) in backend.calls
    assert backend.adapters == {0: set(), 1: set()}


def test_unload_of_a_missing_name_is_not_an_error(client):
    r = client.post(
        "/v1/unload_lora_adapter", json={"lora_name": "policy-v7"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 200 and r.json()["unloaded"] == 0


def test_a_failed_load_resumes_a_paused_fleet(client, backend):
    """TRL pauses, loads, and raises on a failed load before its /resume: the fleet must not stay paused."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/pause", headers=auth).status_code == 200
    backend.fail_load_on = {1}
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": "/etc"}, headers=auth)
    assert r.status_code == 400
    methods = [c[0] for c in backend.calls]
    assert methods[-3:] == ["LoadAdapter", "UndoLoad", "Resume"]
