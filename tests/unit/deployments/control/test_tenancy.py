"""Runs joining and leaving a shared fleet (`deployments.control.tenancy`): a removed run loses its token and its
adapters, and registrations outlive an ingress restart through the bucket, which never holds a token."""

import json

from fastapi.testclient import TestClient

from deployments.api import make_app
from tests.support.fake_fleet import ADMIN, FakeBackend, api_settings, bearer, load, register, sample


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
    from contracts.retry import Backoff
    from core.bucket.records import RunRecords
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
    assert sample(restarted, "alice/policy-v1", bearer(alice)).status_code == 200  # her token still works
    assert restarted.post("/v1/runs", json={"name": "carol"}, headers=ADMIN).status_code == 409  # still full
    assert restarted.delete("/v1/runs/alice", headers=ADMIN).status_code == 200
    again = ingress()
    assert again.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert sample(again, "alice/policy-v1", bearer(alice)).status_code == 403  # anonymous now


def test_a_run_that_leaves_leaves_nothing_behind_in_the_ingress():
    """Removed or released for its silence: the registry, its idle clocks and the fair share's tenants and slots
    gauges are back where they were before it came (`/server_info`'s `spotrl.ingress`), and the replicas were told to
    forget it."""
    import asyncio

    from deployments.control.runs import Runs

    now = [0.0]
    backend = FakeBackend()
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0])
    client = TestClient(make_app(backend, api_settings(max_loras=7, max_staleness=1), runs))

    def tables() -> dict:
        tables = client.get("/server_info", headers=ADMIN).json()["spotrl"]["ingress"]
        return {k: v for k, v in tables.items() if k != "pid"}

    def upkeep_round() -> None:
        asyncio.run(client.app.state.upkeep.once())

    assert sample(client, "policy-v1", ADMIN).status_code == 200  # the fleet's own pseudo-run is always kept
    before = tables()
    for name in ("alice", "bob"):
        token = register(client, name)
        backend.adapters[0].add(f"{name}/policy-v1")
        assert sample(client, f"{name}/policy-v1", bearer(token)).status_code == 200
    upkeep_round()  # the slots gauges of both
    assert tables() == {**before, "runs": 2, "idle_clocks": 2, "fair_share_tenants": 3, "slots_gauges": 2}

    assert client.delete("/v1/runs/alice", headers=ADMIN).status_code == 200
    now[0] = 61.0  # bob goes silent: released by the upkeep
    upkeep_round()
    upkeep_round()  # his slots gauge back to 0, and no longer kept up
    assert tables() == before
    assert set(client.get("/router/stats", headers=ADMIN).json()["runs"]["runs"]) == {"_fleet"}
    assert [c.run for kind, c in backend.calls if kind == "ForgetRun"] == ["alice", "bob"]


class SlowRecords:
    """Run records in memory whose deletes wait for `go` (a bucket that is slow to answer) or fail `fail` times."""

    def __init__(self):
        import threading

        self.saved: dict[str, dict] = {}
        self.go = threading.Event()
        self.go.set()
        self.fail = 0
        self.url = "file:///bucket"

    def save(self, name: str, record: dict) -> None:
        self.saved[name] = record

    def delete(self, name: str) -> None:
        self.go.wait(10)
        if self.fail:
            self.fail -= 1
            raise OSError("the bucket did not answer")
        self.saved.pop(name, None)


def _tenancy(records, clock):
    from deployments.control.errors import Scrub
    from deployments.control.fair_share import FairShare
    from deployments.control.runs import Runs
    from deployments.control.tenancy import Tenancy

    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=clock)
    backend = FakeBackend()
    return Tenancy(runs, records, backend, Scrub(None), FairShare(8, runs.weight)), backend


def test_a_name_registered_again_while_its_release_runs_waits_and_keeps_its_record_and_adapters():
    """The old run's record delete and unload broadcast come first, the new registration after: never the other way
    round (which left the new run with no record, and its adapters unloaded by the old run's ForgetRun)."""
    import asyncio

    now = [0.0]
    records = SlowRecords()
    tenancy, backend = _tenancy(records, lambda: now[0])

    async def main():
        await tenancy.register("alice", None, None, None)
        now[0] = 61.0
        records.go.clear()  # the release's record delete hangs for a while
        releasing = asyncio.create_task(tenancy.release_idle())
        await asyncio.sleep(0.05)
        joining = asyncio.create_task(tenancy.register("alice", None, None, None))
        await asyncio.sleep(0.05)
        assert not joining.done()  # waits for the old run to be gone
        records.go.set()
        assert await releasing == ["alice"]
        await joining
        backend.adapters[0].add("alice/policy-v1")  # the new run's first version

    asyncio.run(main())
    assert "alice" in records.saved and "alice" in tenancy.runs and backend.adapters[0] == {"alice/policy-v1"}
    assert [kind for kind, _ in backend.calls] == ["ForgetRun"]  # the old run's, before the new run loaded anything


def test_a_release_whose_record_delete_failed_is_finished_by_the_upkeep_before_the_name_is_taken_again():
    """A record left behind would bring the released run back with the next ingress: the upkeep retries until it is
    gone, and a registration of the name meanwhile is refused (503) unless the leaving can be finished first."""
    import asyncio

    import pytest

    from deployments.control.errors import ApiError

    now = [0.0]
    records = SlowRecords()
    tenancy, backend = _tenancy(records, lambda: now[0])

    async def main():
        await tenancy.register("alice", None, None, None)
        now[0] = 61.0
        records.fail = 2
        assert await tenancy.release_idle() == ["alice"]
        assert tenancy.leaving == ["alice"] and "alice" in records.saved
        with pytest.raises(ApiError, match="still leaving"):
            await tenancy.register("alice", None, None, None)  # its second failure
        assert await tenancy.finish_leaving() == ["alice"]
        assert tenancy.leaving == [] and "alice" not in records.saved
        assert [kind for kind, _ in backend.calls] == ["ForgetRun"]
        await tenancy.register("alice", None, None, None)

    asyncio.run(main())
    assert "alice" in records.saved
