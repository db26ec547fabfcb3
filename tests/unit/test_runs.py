"""Runs as tenants of one fleet (`deployments.runs`, the `/v1/runs` calls of `deployments.api`) over a fake
backend: who may register, what a run's token may sample, load, unload and see, what the admin may, when a
run no longer fits, and that a run's token shows nowhere but in the answer that mints it."""

import json
import logging

import pytest
from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.unit.test_api import BASE, TOKEN, FakeBackend, _settings

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _bearer(token):
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def fleet():
    backend = FakeBackend()
    return backend, TestClient(make_app(backend, _settings(max_loras=7, max_staleness=1)))


def _register(client, name):
    r = client.post("/v1/runs", json={"name": name}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == name and r.json()["token"].startswith("spotrl-run-")
    return r.json()["token"]


def _sample(client, model, headers=None):
    return client.post("/v1/completions", json={"model": model, "prompt": [1], "max_tokens": 1}, headers=headers)


def _load(client, name, headers):
    return client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "adapters/policy-v2"}, headers=headers
    )


def test_only_the_admin_registers_lists_and_removes_runs(fleet):
    _, client = fleet
    alice = _register(client, "alice")
    _register(client, "bob")
    assert client.post("/v1/runs", json={"name": "carol"}).status_code == 401
    for call in (
        lambda h: client.post("/v1/runs", json={"name": "carol"}, headers=h),
        lambda h: client.delete("/v1/runs/alice", headers=h),
    ):
        r = call(_bearer(alice))
        assert r.status_code == 403 and "admin token" in r.json()["error"]["message"]
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["alice", "bob"]}
    # A run's token lists its own run alone: how a driver handed a token learns whose it is (`app.fleet_run`).
    assert client.get("/v1/runs", headers=_bearer(alice)).json() == {"runs": ["alice"]}
    assert client.get("/v1/runs").status_code == 401
    client.delete("/v1/runs/bob", headers=ADMIN)
    for name, status in (("Alice", 400), ("a/b", 400), ("-x", 400), ("x" * 33, 400), ("alice", 409)):
        r = client.post("/v1/runs", json={"name": name}, headers=ADMIN)
        assert r.status_code == status, (name, r.text)
    assert client.post("/v1/runs", json={"name": "bob", "quota": 3}, headers=ADMIN).status_code == 400
    assert client.delete("/v1/runs/carol", headers=ADMIN).status_code == 404


def test_registration_is_refused_when_the_pinned_sets_no_longer_fit_the_slots(fleet):
    _, client = fleet
    _register(client, "alice")
    _register(client, "bob")  # the fleet's own lineage + 2 runs, 2 versions each, 1 to load into: 7 slots
    r = client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN)
    assert r.status_code == 409
    assert "fleet.max_loras=7" in r.json()["error"]["message"] and "9 LoRA slots" in r.json()["error"]["message"]
    client.delete("/v1/runs/bob", headers=ADMIN)
    _register(client, "carol")  # room again


def test_a_run_token_reaches_the_base_model_and_its_own_adapters_only(fleet):
    backend, client = fleet
    alice, bob = _register(client, "alice"), _register(client, "bob")
    backend.adapters = {0: {"policy-v1", "alice/policy-v1", "bob/policy-v1"}, 1: {"alice/policy-v1", "bob/policy-v1"}}
    mine = _bearer(alice)
    assert _sample(client, BASE, mine).status_code == 200
    assert _sample(client, "tiny", mine).status_code == 200  # the base model's alias
    assert _sample(client, "alice/policy-v1", mine).status_code == 200
    for other in ("bob/policy-v1", "policy-v1"):
        r = _sample(client, other, mine)
        assert r.status_code == 403 and "only its own adapters" in r.json()["error"]["message"], other
    chat = {"model": "bob/policy-v1", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat, headers=mine).status_code == 403
    assert [m["id"] for m in client.get("/v1/models", headers=mine).json()["data"]] == [BASE, "alice/policy-v1"]
    assert all(s["adapters"] == [] for s in client.get("/engine/stats", headers=mine).json()["replicas"])

    assert _load(client, "alice/policy-v2", mine).status_code == 200
    for other in ("bob/policy-v2", "policy-v2", "trl-policy-v2"):
        r = _load(client, other, mine)
        assert r.status_code == 403 and "own adapters (alice/<name>)" in r.json()["error"]["message"], other
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": other}, headers=mine)
        assert r.status_code == 403, other
    assert (
        client.post("/v1/unload_lora_adapter", json={"lora_name": "alice/policy-v2"}, headers=mine).status_code == 200
    )
    for path in ("/pause", "/resume", "/reset_prefix_cache"):  # they stop or change every run's work
        assert client.post(path, headers=mine).status_code == 403, path
    assert "bob/policy-v1" in {a for r in backend.adapters.values() for a in r}  # bob's untouched throughout

    # Without a token (inference is open): the fleet's own adapters, never a run's.
    assert _sample(client, "policy-v1").status_code == 200
    assert _sample(client, "alice/policy-v1").status_code == 403
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [BASE, "policy-v1"]
    # The admin: everything.
    assert _sample(client, "bob/policy-v1", ADMIN).status_code == 200
    assert len(client.get("/v1/models", headers=ADMIN).json()["data"]) == 4
    assert _load(client, "bob/policy-v2", ADMIN).status_code == 200
    assert _sample(client, "bob/policy-v1", _bearer(bob)).status_code == 200


def test_a_removed_run_loses_its_token_and_its_adapters(fleet):
    backend, client = fleet
    alice = _register(client, "alice")
    _register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "alice/policy-v2", "bob/policy-v1"}, 1: {"alice/policy-v2"}}
    r = client.delete("/v1/runs/alice", headers=ADMIN)
    assert r.status_code == 200 and r.json()["unloaded"] == ["alice/policy-v1", "alice/policy-v2"]
    assert backend.adapters == {0: {"bob/policy-v1"}, 1: set()}
    assert _load(client, "alice/policy-v3", _bearer(alice)).status_code == 401
    assert _sample(client, "alice/policy-v1", _bearer(alice)).status_code == 403  # anonymous now
    assert _register(client, "alice") != alice  # registering again mints a new token


def test_a_run_token_shows_nowhere_but_in_the_answer_that_mints_it(fleet, caplog):
    from contracts.auth import redact

    caplog.set_level(logging.DEBUG)
    _, client = fleet
    token = _register(client, "alice")
    assert token not in client.get("/v1/runs", headers=ADMIN).text
    responses = [
        _sample(client, token, _bearer(token)),  # a model named like the token: 403, the name scrubbed
        _sample(client, f"alice/{token}", _bearer(token)),  # 404 naming the model
        client.post("/v1/runs", json={"name": token}, headers=ADMIN),  # 400 quoting the name
        _load(client, "bob/x", _bearer(token + "x")),  # a wrong token: 401
    ]
    assert [r.status_code for r in responses] == [403, 404, 400, 401]
    assert not [r.text for r in responses if token in r.text]
    assert token not in caplog.text
    assert redact(f"Authorization: Bearer {token}") == "Authorization: Bearer ***"


def test_the_registry_keeps_only_the_tokens_sha256():
    from deployments.runs import Runs

    runs = Runs(max_loras=7, max_staleness=1)
    token = runs.register("alice")
    assert runs.run_of(token) == "alice" and runs.run_of(token + "x") is None
    assert token not in repr(runs) and token not in repr(vars(runs))


def test_a_run_that_goes_silent_is_released_by_the_next_request_and_a_heartbeat_keeps_one_alive():
    """A run killed without a goodbye: after `fleet.run_idle_timeout_s` its token and its slots are freed."""
    from deployments.runs import Runs

    now = [0.0]
    backend = FakeBackend()
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0])
    client = TestClient(make_app(backend, _settings(max_loras=7, max_staleness=1), runs))
    alice, bob = _register(client, "alice"), _register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "bob/policy-v1"}, 1: {"alice/policy-v1", "bob/policy-v1"}}
    assert client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 409  # full

    now[0] = 40.0
    assert client.post("/v1/runs/bob/heartbeat", headers=_bearer(bob)).json() == {"name": "bob", "idle_timeout_s": 60}
    assert client.post("/v1/runs/alice/heartbeat", headers=_bearer(bob)).status_code == 403  # only its own
    now[0] = 70.0  # alice silent for 70 s, bob for 30 s
    assert client.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 200  # alice's place
    assert backend.adapters == {0: {"bob/policy-v1"}, 1: {"bob/policy-v1"}}
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob", "carol"]}
    assert _load(client, "alice/policy-v2", _bearer(alice)).status_code == 401
    now[0] = 95.0
    assert _sample(client, "bob/policy-v1", _bearer(bob)).status_code == 200  # a request is a heartbeat too
    now[0] = 150.0  # bob heard of at 95, carol at 70
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert client.post("/v1/runs/carol/heartbeat", headers=ADMIN).status_code == 404


def test_a_release_that_cannot_unload_never_fails_the_request_that_triggered_it():
    from contracts.control import ListAdapters
    from contracts.serving import ReplicaError
    from deployments.runs import Runs

    class Failing(FakeBackend):
        async def broadcast(self, command):
            if isinstance(command, ListAdapters) and self.broken:
                return [ReplicaError("bucket unavailable", 503)]
            return await super().broadcast(command)

    now, backend = [0.0], Failing()
    backend.broken = False
    client = TestClient(
        make_app(backend, _settings(), Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0]))
    )
    _register(client, "alice")
    backend.broken, now[0] = True, 61.0
    assert _sample(client, BASE).status_code == 200  # someone else's request: answered all the same
    backend.broken = False
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": []}


def test_registrations_outlive_an_ingress_restart_through_the_bucket_which_never_holds_a_token(tmp_path):
    """A fresh ingress (its node lost, the app redeployed) restores the runs from the bucket, tokens and all."""
    from app.bucket.records import RunRecords
    from contracts.retry import Backoff
    from deployments.runs import Registration, Runs

    def ingress():
        records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
        runs = Runs(max_loras=7, max_staleness=1)
        runs.restore({name: Registration.from_record(r) for name, r in records.load().items()})
        return TestClient(make_app(FakeBackend(), _settings(max_loras=7, max_staleness=1), runs, records))

    first = ingress()
    alice = _register(first, "alice")
    r = first.post("/v1/runs", json={"name": "bob", "weight": 3}, headers=ADMIN)
    bob = r.json()["token"]
    records = sorted((tmp_path / "bucket").rglob("RUN.json"))
    stored = "".join(p.read_text() for p in records)
    assert alice not in stored and bob not in stored and "alice" in stored
    # Outside every run's prefix (`<bucket>/runs/<name>`, which the run itself may write): a run cannot rewrite its
    # weight there, nor register a run by planting a record.
    assert [p.relative_to(tmp_path / "bucket").as_posix() for p in records] == [
        "fleet/runs/alice/RUN.json",
        "fleet/runs/bob/RUN.json",
    ]
    planted = tmp_path / "bucket" / "runs" / "bob" / "RUN.json"  # bob's own prefix: what he may write
    planted.parent.mkdir(parents=True)
    planted.write_text(json.dumps({"name": "bob", "token_sha256": "0" * 64, "weight": 1000.0}))

    restarted = ingress()
    assert restarted.get("/v1/runs", headers=ADMIN).json() == {"runs": ["alice", "bob"]}
    weights = {n: restarted.get(f"/v1/runs/{n}", headers=ADMIN).json()["weight"] for n in ("alice", "bob")}
    assert weights == {"alice": 1.0, "bob": 3.0}  # registered with, the default for none; not what bob planted
    assert _sample(restarted, "alice/policy-v1", _bearer(alice)).status_code == 200  # her token still works
    assert restarted.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 409  # still full
    assert restarted.delete("/v1/runs/alice", headers=ADMIN).status_code == 200
    again = ingress()
    assert again.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert _sample(again, "alice/policy-v1", _bearer(alice)).status_code == 403  # anonymous now


def test_a_run_learns_its_prefix_of_the_fleets_bucket_and_nobody_elses(tmp_path):
    """`GET /v1/runs/NAME`: where run NAME must publish (the only place the fleet loads its adapters from) and how
    long it may stay silent; for its own token and the admin's, a 403 for another run's, a 404 for no run."""
    from app.bucket.records import RunRecords
    from contracts.retry import Backoff

    records = RunRecords(f"file://{tmp_path}/bucket", backoff=Backoff(attempts=1, first_s=0.0))
    client = TestClient(
        make_app(FakeBackend(), _settings(max_loras=7, max_staleness=1, run_idle_timeout_s=45.0), None, records)
    )
    alice, bob = _register(client, "alice"), _register(client, "bob")
    info = client.get("/v1/runs/alice", headers=_bearer(alice)).json()
    assert info == {
        "name": "alice",
        "bucket_url": f"file://{tmp_path}/bucket/runs/alice",
        "idle_timeout_s": 45.0,
        "weight": 1.0,
        "max_staleness": 1,
        "lora_rank": None,
    }
    assert client.get("/v1/runs/alice", headers=ADMIN).json() == info
    r = client.get("/v1/runs/alice", headers=_bearer(bob))
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


def test_router_stats_count_each_runs_requests_tokens_and_slots_and_a_run_sees_only_its_own(fleet):
    backend, client = fleet
    alice, bob = _register(client, "alice"), _register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "policy-v1"}, 1: {"alice/policy-v1"}}
    body = {"model": "alice/policy-v1", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers=_bearer(alice)).status_code == 200
    assert _sample(client, BASE, _bearer(bob)).status_code == 200
    assert _sample(client, BASE, ADMIN).status_code == 200  # the admin's share is the fleet's pseudo-run

    fair = client.get("/router/stats", headers=ADMIN).json()["runs"]
    runs = fair["runs"]
    assert fair["in_flight"] == 0 and set(runs) == {"alice", "bob", "_fleet"}
    assert (runs["alice"]["requests"], runs["alice"]["prompt_tokens"], runs["alice"]["completion_tokens"]) == (2, 5, 4)
    assert (runs["bob"]["requests"], runs["bob"]["prompt_tokens"], runs["bob"]["completion_tokens"]) == (1, 1, 1)
    assert runs["alice"]["slots_held"] == 1 and runs["bob"]["slots_held"] == 0 and runs["_fleet"]["slots_held"] == 1
    assert set(client.get("/router/stats", headers=_bearer(bob)).json()["runs"]["runs"]) == {"bob"}


def test_a_run_registers_with_its_own_window_and_rank_and_the_fleet_checks_both():
    """Slots are pinned per run by the window it states (max_staleness + 1); a rank above the engines' is a 400."""
    client = TestClient(make_app(FakeBackend(), _settings(max_loras=9, max_staleness=1, max_lora_rank=8)))
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
