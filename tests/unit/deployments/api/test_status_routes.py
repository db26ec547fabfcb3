"""What the fleet says of itself (`deployments.api.status_routes`): what TRL reads of `/server_info`, the
per-run counters of `/router/stats`, and that reading changes nothing."""

import copy

from fastapi.testclient import TestClient

from deployments.api import make_app
from deployments.control.fair_share import FairShare
from deployments.control.runs import Runs
from tests.support.fake_fleet import ADMIN, BASE, FakeBackend, api_settings, bearer, register, sample


def test_server_info_has_what_trl_reads(client):
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["lora_config"]["max_loras"] == 4 and info["parallel_config"]["data_parallel_size"] == 1
    assert client.get("/server_info", params={"config_format": "yaml"}).status_code == 400


def test_router_stats_count_each_runs_requests_tokens_and_slots_and_a_run_sees_only_its_own(fleet):
    backend, client = fleet
    alice, bob = register(client, "alice"), register(client, "bob")
    backend.adapters = {0: {"alice/policy-v1", "policy-v1"}, 1: {"alice/policy-v1"}}
    body = {"model": "alice/policy-v1", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers=bearer(alice)).status_code == 200
    assert sample(client, BASE, bearer(bob)).status_code == 200
    assert sample(client, BASE, ADMIN).status_code == 200  # the admin's share is the fleet's pseudo-run

    fair = client.get("/router/stats", headers=ADMIN).json()["runs"]
    runs = fair["runs"]
    assert fair["in_flight"] == 0 and set(runs) == {"alice", "bob", "_fleet"}
    assert (runs["alice"]["requests"], runs["alice"]["prompt_tokens"], runs["alice"]["completion_tokens"]) == (2, 5, 4)
    assert (runs["bob"]["requests"], runs["bob"]["prompt_tokens"], runs["bob"]["completion_tokens"]) == (1, 1, 1)
    assert runs["alice"]["slots_held"] == 1 and runs["bob"]["slots_held"] == 0 and runs["_fleet"]["slots_held"] == 1
    assert set(client.get("/router/stats", headers=bearer(bob)).json()["runs"]["runs"]) == {"bob"}


def test_no_get_changes_anything():
    """Every GET route, for the admin, a run and anonymous: the registry, the runs' idle clocks and the fair share
    are as they were (a run is not heard of by reading, slots are counted for the answer and not stored)."""
    now = [0.0]
    backend = FakeBackend()
    runs = Runs(max_loras=7, max_staleness=1, clock=lambda: now[0])
    gate = FairShare(8, runs.weight)
    app = make_app(backend, api_settings(max_loras=7, max_staleness=1), runs, gate=gate)
    client = TestClient(app)
    alice = register(client, "alice")
    register(client, "bob")
    assert sample(client, BASE, bearer(alice)).status_code == 200
    backend.adapters = {0: {"alice/policy-v1", "bob/policy-v1", "policy-v1"}, 1: {"alice/policy-v1"}}
    now[0] = 10.0  # a run heard of by a GET would be heard of at 10

    before = copy.deepcopy(vars(runs)), gate.stats()
    paths = sorted(r.path.replace("{name}", "alice") for r in app.routes if "GET" in getattr(r, "methods", ()))
    assert {"/health", "/server_info", "/router/stats", "/engine/stats", "/v1/models", "/v1/runs"} < set(paths)
    for headers in (ADMIN, bearer(alice), {}):
        for path in paths:
            assert client.get(path, headers=headers).status_code in (200, 401), (path, headers)
    assert (copy.deepcopy(vars(runs)), gate.stats()) == before
