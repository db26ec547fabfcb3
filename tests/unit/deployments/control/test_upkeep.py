"""The ingress's background upkeep (`deployments.control.upkeep`): a run gone silent is released, a heartbeat or a
request that uses the fleet keeps one alive (reading does not), a release that fails or takes long never touches
a request, and the slots gauges are refreshed by the upkeep rather than by whoever reads the stats."""

import asyncio
import time

import httpx
from fastapi.testclient import TestClient

from contracts.control import ForgetRun, ListAdapters
from contracts.serving import ReplicaError
from deployments.api import make_app
from deployments.control.fair_share import FairShare
from deployments.control.runs import Runs
from tests.support.fake_fleet import ADMIN, BASE, FakeBackend, api_settings, bearer, load, register, sample


def upkeep_round(client: TestClient) -> None:
    """One round of the upkeep, as its background task runs it every few seconds."""
    asyncio.run(client.app.state.upkeep.once())


def test_a_run_that_goes_silent_is_released_by_the_upkeep_and_a_heartbeat_keeps_one_alive():
    """A run killed without a goodbye: after `fleet.run_idle_timeout_s` its token and its slots are freed."""
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
    upkeep_round(client)
    carol = register(client, "carol")  # alice's place
    assert backend.adapters == {0: {"bob/policy-v1"}, 1: {"bob/policy-v1"}}
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob", "carol"]}
    assert load(client, "alice/policy-v2", bearer(alice)).status_code == 401
    now[0] = 95.0
    assert sample(client, "bob/policy-v1", bearer(bob)).status_code == 200  # a request is a heartbeat too
    assert client.get("/v1/models", headers=bearer(carol)).status_code == 200  # reading is not
    now[0] = 150.0  # bob heard of at 95, carol at 70
    upkeep_round(client)
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": ["bob"]}
    assert client.post("/v1/runs/carol/heartbeat", headers=ADMIN).status_code == 404


class Failing(FakeBackend):
    """Replicas that cannot list their adapters (so nothing can be unloaded) while `broken`."""

    broken = False

    async def broadcast(self, command):
        if isinstance(command, ListAdapters) and self.broken:
            return [ReplicaError("bucket unavailable", 503)]
        return await super().broadcast(command)


def test_a_release_that_cannot_unload_still_releases_the_run_and_fails_no_request():
    now, backend = [0.0], Failing()
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0])
    client = TestClient(make_app(backend, api_settings(), runs))
    register(client, "alice")
    backend.broken, now[0] = True, 61.0
    upkeep_round(client)  # logs the failure, raises nothing
    assert sample(client, BASE).status_code == 200  # someone else's request: answered all the same
    backend.broken = False
    assert client.get("/v1/runs", headers=ADMIN).json() == {"runs": []}


class SlowToUnload(FakeBackend):
    """Replicas that take until the test lets them finish to forget a run (unload its adapters)."""

    def __init__(self):
        super().__init__()
        self.unloading, self.finish = asyncio.Event(), asyncio.Event()

    async def broadcast(self, command):
        if isinstance(command, ForgetRun):
            self.unloading.set()
            await self.finish.wait()
        return await super().broadcast(command)


def test_a_request_is_answered_at_once_while_a_release_is_slow():
    """No request waits on another run's cleanup: not before the upkeep has released a run gone silent, nor while
    it does."""
    now = [0.0]
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=60.0, clock=lambda: now[0])
    backend = SlowToUnload()
    app = make_app(backend, api_settings(max_loras=7, max_staleness=1), runs)

    async def answers(http) -> list[str]:
        """A generation, a probe and a listing at once, each within a second: what they answered."""
        body = {"model": BASE, "prompt": [1], "max_tokens": 1}
        replies = await asyncio.wait_for(
            asyncio.gather(
                http.post("/v1/completions", json=body), http.get("/health"), http.get("/v1/runs", headers=ADMIN)
            ),
            1.0,
        )
        assert [r.status_code for r in replies] == [200, 200, 200]
        return replies[-1].json()["runs"]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fleet") as http:
            assert (await http.post("/v1/runs", json={"name": "alice"}, headers=ADMIN)).status_code == 200
            backend.adapters = {0: {"alice/policy-v1"}, 1: {"alice/policy-v1"}}
            now[0] = 61.0  # alice is silent past her timeout: the next round of the upkeep releases her
            assert await answers(http) == ["alice"]
            release = asyncio.create_task(app.state.upkeep.once())
            await asyncio.wait_for(backend.unloading.wait(), 5)  # her adapters are being unloaded, slowly
            assert await answers(http) == [] and not release.done()
            backend.finish.set()
            await release

    asyncio.run(main())
    assert backend.adapters == {0: set(), 1: set()}


def test_the_upkeep_runs_while_the_app_serves():
    runs = Runs(max_loras=7, max_staleness=1, idle_timeout_s=0.2)  # a round every 0.05 s
    with TestClient(make_app(FakeBackend(), api_settings(), runs)) as client:
        register(client, "alice")
        deadline = time.monotonic() + 10
        while client.get("/v1/runs", headers=ADMIN).json()["runs"]:  # reading keeps nobody alive
            assert time.monotonic() < deadline, "alice was never released"
            time.sleep(0.05)


class GaugeRecorder:
    """`RunMetrics` as the gate calls it, keeping the latest slots gauge of each run."""

    def __init__(self):
        self.held = {}

    def waited(self, run, wait_s):
        pass

    def used(self, run, prompt_tokens, completion_tokens):
        pass

    def places(self, run, in_flight, queued):
        pass

    def slots(self, run, held):
        self.held[run] = held


def test_the_slots_gauges_are_refreshed_by_the_upkeep_not_by_reading_the_stats():
    backend, gauges, runs = FakeBackend(), GaugeRecorder(), Runs(max_loras=7, max_staleness=1)
    client = TestClient(make_app(backend, api_settings(), runs, gate=FairShare(8, runs.weight, gauges)))
    register(client, "alice")
    backend.adapters = {0: {"alice/policy-v1", "policy-v1"}, 1: {"alice/policy-v1", "alice/policy-v2"}}
    assert client.get("/router/stats", headers=ADMIN).json()["runs"]["runs"]["alice"]["slots_held"] == 2
    assert client.get("/v1/models", headers=ADMIN).status_code == 200
    assert gauges.held == {}
    upkeep_round(client)
    assert gauges.held == {"alice": 2, "_fleet": 1}
    backend.adapters = {0: set(), 1: {"policy-v1"}}
    upkeep_round(client)
    assert gauges.held == {"alice": 0, "_fleet": 1}  # a run that holds no slot now says so
