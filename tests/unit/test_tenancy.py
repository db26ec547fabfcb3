"""Runs joining and leaving a shared fleet (`deployments.control.tenancy`): a removed run loses its token and its
adapters, a run gone silent is released by the next request and a heartbeat keeps one alive, and registrations
outlive an ingress restart through the bucket, which never holds a token."""

from fastapi.testclient import TestClient

from contracts.control import ListAdapters
from deployments.api import make_app
from tests.unit.fake_fleet import ADMIN, BASE, FakeBackend, api_settings, bearer, load, register, sample


def test_a_removed_run_loses_its_token_and_its_adapters(fleet):
    backend, client = fleet
    alice = register(client, "alice")
    register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "alice/policy-v2", "bob/policy-v1"}, 1: {"alice/policy-v2"}}
    r = client.delete("/v1/runs/alice", headers=ADMIN)
    assert r.status_code == 200 and r.json()["unloaded"] == ["alice/policy-v1", "alice/policy-v2"]
    assert backend.adapters == {0: {"bob/policy-v1"}, 1: set()}
    assert load(client, "alice/policy-v3", bearer(alice)).status_code == 401
    assert sample(client, "alice/policy-v1", bearer(alice)).status_code == 403  # anonymous now
    assert register(client, "alice") != alice  # registering again mints a new token


def test_registrations_outlive_an_ingress_restart_through_the_bucket_which_never_holds_a_token(tmp_path):
    """A fresh ingress (its node lost, the app redeployed) restores the runs from the bucket, tokens and all."""
    from app.bucket.store import RunRecords
    from contracts.retry import Backoff
    from deployments.control.runs import Registration, Runs

    def ingress():
        records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
        runs = Runs(max_loras=7, max_staleness=1)
        runs.restore({name: Registration.from_record(r) for name, r in records.load().items()})
        return TestClient(make_app(FakeBackend(), api_settings(max_loras=7, max_staleness=1), runs, records))

    first = ingress()
    alice = register(first, "alice")
    r = first.post("/v1/runs", json={"name": "bob", "weight": 3}, headers=ADMIN)
    bob = r.json()["token"]
    stored = "".join(p.read_text() for p in (tmp_path / "bucket").rglob("RUN.json"))
    assert alice not in stored and bob not in stored and "alice" in stored

    restarted = ingress()
    assert restarted.get("/v1/runs", headers=ADMIN).json() == {"runs": ["alice", "bob"]}
    weights = {n: restarted.get(f"/v1/runs/{n}", headers=ADMIN).json()["weight"] for n in ("alice", "bob")}
    assert weights == {"alice": 1.0, "bob": 3.0}  # the weight it registered with, the default for none
    assert sample(restarted, "alice/policy-v1", bearer(alice)).status_code == 200  # her token still works
    assert restarted.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 409  # still full
    assert restarted.delete("/v1/runs/alice", headers=ADMIN).status_code == 200
    again = ingress()
    assert again.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert sample(again, "alice/policy-v1", bearer(alice)).status_code == 403  # anonymous now


def test_a_run_that_goes_silent_is_released_by_the_next_request_and_a_heartbeat_keeps_one_alive():
    """A run killed without a goodbye: after `fleet.run_idle_timeout_s` its token and its slots are freed."""
    from deployments.control.runs import Runs

    now = [0.0]
    backend = FakeBackend()
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0])
    client = TestClient(make_app(backend, api_settings(max_loras=7, max_staleness=1), runs))
    alice, bob = register(client, "alice"), register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "bob/policy-v1"}, 1: {"alice/policy-v1", "bob/policy-v1"}}
    assert client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 409  # full

    now[0] = 40.0
    assert client.post("/v1/runs/bob/heartbeat", headers=bearer(bob)).json() == {"name": "bob", "idle_timeout_s": 60}
    assert client.post("/v1/runs/alice/heartbeat", headers=bearer(bob)).status_code == 403  # only its own
    now[0] = 70.0  # alice silent for 70 s, bob for 30 s
    assert client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 200  # alice's place
    assert backend.adapters == {0: {"bob/policy-v1"}, 1: {"bob/policy-v1"}}
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob", "carol"]}
    assert load(client, "alice/policy-v2", bearer(alice)).status_code == 401
    now[0] = 95.0
    assert sample(client, "bob/policy-v1", bearer(bob)).status_code == 200  # a request is a heartbeat too
    now[0] = 150.0  # bob heard of at 95, carol at 70
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert client.post("/v1/runs/carol/heartbeat", headers=ADMIN).status_code == 404


def test_a_release_that_cannot_unload_never_fails_the_request_that_triggered_it():
    from contracts.serving import ReplicaError
    from deployments.control.runs import Runs

    class Failing(FakeBackend):
        async def broadcast(self, command):
            if isinstance(command, ListAdapters) and self.broken:
                return [ReplicaError("bucket unavailable", 503)]
            return await super().broadcast(command)

    now, backend = [0.0], Failing()
    backend.broken = False
    client = TestClient(
        make_app(backend, api_settings(), Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0]))
    )
    register(client, "alice")
    backend.broken, now[0] = True, 61.0
    assert sample(client, BASE).status_code == 200  # someone else's request: answered all the same
    backend.broken = False
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": []}
