"""The runs of a shared fleet over HTTP (`deployments.api.run_routes`): who may register, list, see and remove
runs, and that a run's token shows nowhere but in the answer that mints it."""

import logging

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings, bearer, load, register, sample


def test_only_the_admin_registers_lists_and_removes_runs(fleet):
    _, client = fleet
    alice = register(client, "alice")
    register(client, "bob")
    assert client.post("/v1/runs", json={"name": "carol"}).status_code == 401
    for call in (
        lambda h: client.post("/v1/runs", json={"name": "carol"}, headers=h),
        lambda h: client.delete("/v1/runs/alice", headers=h),
    ):
        r = call(bearer(alice))
        assert r.status_code == 403 and "admin token" in r.json()["error"]["message"]
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["alice", "bob"]}
    # A run's token lists its own run alone: how a driver handed a token learns whose it is (`app.fleet_run`).
    assert client.get("/v1/runs", headers=bearer(alice)).json() == {"runs": ["alice"]}
    assert client.get("/v1/runs").status_code == 401
    client.delete("/v1/runs/bob", headers=ADMIN)
    for name, status in (("Alice", 400), ("a/b", 400), ("-x", 400), ("x" * 33, 400), ("alice", 409)):
        r = client.post("/v1/runs", json={"name": name}, headers=ADMIN)
        assert r.status_code == status, (name, r.text)
    assert client.post("/v1/runs", json={"name": "bob", "quota": 3}, headers=ADMIN).status_code == 400
    assert client.delete("/v1/runs/carol", headers=ADMIN).status_code == 404


def test_a_run_token_shows_nowhere_but_in_the_answer_that_mints_it(fleet, caplog):
    from contracts.auth import redact

    caplog.set_level(logging.DEBUG)
    _, client = fleet
    token = register(client, "alice")
    assert token not in client.get("/v1/runs", headers=ADMIN).text
    responses = [
        sample(client, token, bearer(token)),  # a model named like the token: 403, the name scrubbed
        sample(client, f"alice/{token}", bearer(token)),  # 404 naming the model
        client.post("/v1/runs", json={"name": token}, headers=ADMIN),  # 400 quoting the name
        load(client, "bob/x", bearer(token + "x")),  # a wrong token: 401
    ]
    assert [r.status_code for r in responses] == [403, 404, 400, 401]
    assert not [r.text for r in responses if token in r.text]
    assert token not in caplog.text
    assert redact(f"Authorization: Bearer {token}") == "Authorization: Bearer ***"


def test_a_run_learns_its_prefix_of_the_fleets_bucket_and_nobody_elses(tmp_path):
    """`GET /v1/runs/NAME`: where run NAME must publish (the only place the fleet loads its adapters from) and how
    long it may stay silent; for its own token and the admin's, a 403 for another run's, a 404 for no run."""
    from contracts.retry import Backoff
    from core.bucket.records import RunRecords

    records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
    client = TestClient(
        make_app(FakeBackend(), api_settings(max_loras=7, max_staleness=1, run_idle_timeout_s=45.0), None, records)
    )
    alice, bob = register(client, "alice"), register(client, "bob")
    info = client.get("/v1/runs/alice", headers=bearer(alice)).json()
    assert info == {
        "name": "alice",
        "bucket_url": f"file://{tmp_path}/bucket/runs/alice",
        "idle_timeout_s": 45.0,
        "weight": 1.0,
        "max_staleness": 1,
        "lora_rank": None,
        "lineages": 1,
    }
    assert client.get("/v1/runs/alice", headers=ADMIN).json() == info
    r = client.get("/v1/runs/alice", headers=bearer(bob))
    assert r.status_code == 403 and "only its own run" in r.json()["error"]["message"]
    assert client.get("/v1/runs/alice").status_code == 401
    assert client.get("/v1/runs/carol", headers=ADMIN).status_code == 404


def test_a_run_registers_with_a_weight_and_a_bad_one_is_a_400(fleet):
    _, client = fleet
    r = client.post("/v1/runs", json={"name": "alice", "weight": 3}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["weight"] == 3.0
    assert client.post("/v1/runs", json={"name": "bob"}, headers=ADMIN).json()["weight"] == 1.0  # the default
    for bad in (-1, 0, "heavy", 1e7):
        r = client.post("/v1/runs", json={"name": "carol", "weight": bad}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("weight:"), (bad, r.text)
    assert sorted(client.get("/v1/runs", headers=ADMIN).json()["runs"]) == ["alice", "bob"]


def test_each_lineage_gets_its_own_signing_key_and_only_its_own(fleet):
    """A run's token gets the key its versions are signed with; the admin the fleet's own lineage's, or any run's;
    no run another's (the key is what keeps one run from publishing as another)."""
    from contracts.auth import lineage_key, signing_secret
    from tests.support.fake_fleet import TOKEN

    _, client = fleet
    alice, bob = register(client, "alice"), register(client, "bob")
    secret = signing_secret(TOKEN)
    mine = client.get("/v1/signing_key", headers=bearer(alice)).json()
    assert mine == {"run": "alice", "key": lineage_key(secret, "alice").value}
    assert client.get("/v1/signing_key", headers=bearer(bob)).json()["key"] == lineage_key(secret, "bob").value
    assert mine["key"] != lineage_key(secret, "bob").value != lineage_key(secret, None).value
    assert client.get("/v1/signing_key", headers=ADMIN).json() == {"run": None, "key": lineage_key(secret, None).value}
    assert client.get("/v1/signing_key", params={"run": "bob"}, headers=ADMIN).json()["run"] == "bob"
    assert client.get("/v1/signing_key", params={"run": "bob"}, headers=bearer(alice)).status_code == 403
    assert client.get("/v1/signing_key", params={"run": "carol"}, headers=ADMIN).status_code == 404
    assert client.get("/v1/signing_key").status_code == 401
    assert signing_secret(TOKEN).value != signing_secret("another-admin-token").value  # only the token's holder
