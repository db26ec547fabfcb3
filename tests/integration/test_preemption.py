"""Fault injection on a spot-like Ray cluster on one machine: lose the learner's node, a replica's node, the bucket.

`ray.cluster_utils.Cluster` starts a head (the driver's side: Serve's proxy, the ingress, the rollout
actor) and three worker nodes with the custom resources of cluster.yaml: one `learner_node`, two
`rollout_node`s, each with one vLLM replica. Everything listens on 127.0.0.1; the bucket is a real
SeaweedFS S3 server. The three tests are three legs of one run (one fleet, one bucket), each a
`python -m app.train --address ...` driver that resumes where the previous one stopped, with one
fault injected in its middle. Each prints its recovery time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest

from app.local_ray import SINGLE_MACHINE_ENV
from tests.s3_server import S3Server, free_base_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny-cpu.yaml"
STEPS_PER_LEG = 9
SAVE_STEPS = 3  # a leg ends on a checkpoint, so the next one starts exactly there
LEARNER_NODE = {"learner_node": 1}
ROLLOUT_NODE = {"rollout_node": 1}
# Ray advertises the machine's outward address unless told that this is a one-machine "cluster" (app/local_ray.py).
LOOPBACK_ENV = SINGLE_MACHINE_ENV

pytestmark = pytest.mark.slow


class SpotCluster:
    """The cluster, its S3 server and the run's settings, with the faults the tests inject."""

    def __init__(self, tmp: Path, s3: S3Server):
        from ray.cluster_utils import Cluster

        from app.local_ray import loopback_system_config
        from tests.fleet_helpers import free_port

        self.tmp, self.s3 = tmp, s3
        self.bucket = s3.make_bucket("spot") + "/run"
        self.port = free_port()
        node = {"node_ip_address": "127.0.0.1", "object_store_memory": 150 * 2**20}
        # Loopback only, as `make train`'s Ray (app/local_ray.py); the system config reaches every node through the GCS.
        head = {**node, "num_cpus": 2, "include_dashboard": False, "_system_config": loopback_system_config()}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._node_args = node
        self.learner_node = self.add_node(LEARNER_NODE, num_cpus=2)
        self.rollout_nodes = [self.add_node(ROLLOUT_NODE) for _ in range(2)]

    def add_node(self, resources: dict, num_cpus: int = 1):
        return self.cluster.add_node(**self._node_args, num_cpus=num_cpus, resources=resources)

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def run_dir(self) -> Path:
        return self.tmp / "spot"

    def overrides(self) -> list[str]:
        return [
            "logging.run_name=spot",
            f"logging.output_dir={self.tmp}",
            "logging.progress_bar=false",
            "logging.trackio=false",
            f"bucket.url={self.bucket}",
            f"bucket.endpoint_url={self.s3.endpoint_url}",
            f"bucket.cache_dir={self.tmp}/cache",
            f"fleet.port={self.port}",
            "fleet.replica_resources={rollout_node: 1}",
            "learner.ray_resources={learner_node: 1}",
            f"learner.save_steps={SAVE_STEPS}",
            "task.num_heldout=32",
        ]

    def config(self):
        """What each driver runs (`start_driver`), so the fleet serves the base model the drivers train."""
        from app.config import load_config

        return load_config(REPO / CONFIG, self.overrides())

    def resume_step(self) -> int:
        from app.bucket.store import CheckpointStore

        return CheckpointStore.from_config(self.config()).latest() or 0

    def start_driver(self, max_steps: int) -> subprocess.Popen:
        args = [a for s in [*self.overrides(), f"grpo.max_steps={max_steps}"] for a in ("--set", s)]
        self.log_path = self.tmp / f"driver-{max_steps}.log"
        return subprocess.Popen(
            [sys.executable, "-m", "app.train", "--config", CONFIG, "--address", self.address, *args],
            cwd=REPO,
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **LOOPBACK_ENV},
        )

    def driver_log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_step(self, proc, step: int, timeout_s: float = 600) -> float:
        """Block until the run logged `step`; returns when that happened (time.time())."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if any(m["step"] >= step for m in self.metrics()):
                return time.time()
            assert proc.poll() is None, f"the driver ended early:\n{self.driver_log()}"
            time.sleep(0.5)
        raise AssertionError(f"step {step} not reached in {timeout_s:.0f} s:\n{self.driver_log()}")

    def finish(self, proc, timeout_s: float = 900) -> dict:
        rc = proc.wait(timeout_s)
        assert rc == 0, self.driver_log()
        return json.loads((self.run_dir / "summary.json").read_text())

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    import ray

    from app.local_ray import single_machine_mode
    from app.models import resolve_model_path
    from deployments.fleet import deploy_fleet

    tmp = tmp_path_factory.mktemp("spot")
    s3 = S3Server(tmp / "s3", free_base_port()).start()  # fixed ports: it comes back where it was
    saved_env = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())  # the nodes (started next) and the drivers inherit the credentials
    spot = None
    # Ray's one-machine mode (what LOOPBACK_ENV does for the drivers) for this process and every node it
    # starts, now and when a test replaces one: all of them listen on 127.0.0.1 only.
    with single_machine_mode():
        try:
            spot = SpotCluster(tmp, s3)
            ray.init(address=spot.address)
            t0 = time.time()
            cfg = spot.config()  # task.num_heldout=32: a tiny model of its own (its warm-up never sees those 32)
            deploy_fleet(cfg.own_fleet(), resolve_model_path(cfg.model, cfg.task))
            report(f"spot cluster: fleet of 2 replicas up in {time.time() - t0:.0f} s")
            yield spot
        finally:
            if spot is not None:
                spot.shutdown()
            s3.kill()
            for k, v in saved_env.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


_pytest_config = None


@pytest.fixture(scope="session", autouse=True)
def _remember_pytest_config(request):
    global _pytest_config
    _pytest_config = request.config


def report(line: str) -> None:
    """Print past pytest's capture: the recovery times belong in `make test`'s output."""
    print(line)
    if _pytest_config is None:
        return
    capture = _pytest_config.pluginmanager.getplugin("capturemanager")
    terminal = _pytest_config.pluginmanager.getplugin("terminalreporter")
    with capture.global_and_fixture_disabled():
        terminal.write_line(f"[preemption] {line}")


def lineage(trained_log: Path) -> dict[int, list[str]]:
    """Group ids trained per step, as the final policy descends from them: a resumed learner repeats the
    step numbers after its checkpoint, and the later record of a step replaces the lost one."""
    steps: dict[int, list[str]] = {}
    for line in trained_log.read_text().splitlines():
        rec = json.loads(line)
        for later in [s for s in steps if s >= rec["step"]]:
            del steps[later]
        steps[rec["step"]] = rec["groups"]
    return steps


def assert_exactly_once(spot: SpotCluster, final_step: int) -> None:
    steps = lineage(spot.run_dir / "trained_groups.jsonl")
    assert sorted(steps) == list(range(1, final_step + 1))
    ids = [g for groups in steps.values() for g in groups]
    assert len(ids) == len(set(ids)), "a group was trained twice"


def assert_versions_whole(spot: SpotCluster) -> list[int]:
    """Every committed version downloads and matches its manifest's checksums; none is missing."""
    from app.bucket.store import AdapterStore

    store = AdapterStore.from_config(spot.config())
    versions = sorted(store.versions())
    for v in versions:
        store.fetch(v)  # raises IntegrityError on a partial or corrupt version
    assert versions == list(range(versions[0], versions[-1] + 1)), versions
    return versions


def test_losing_the_learner_node_resumes_from_the_bucket_without_training_a_group_twice(spot):
    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + SAVE_STEPS + 1)  # past a checkpoint of this leg

    killed_at = time.time()
    spot.cluster.remove_node(spot.learner_node, allow_graceful=False)  # the spot node is gone, no warning
    spot.learner_node = spot.add_node(LEARNER_NODE, num_cpus=2)  # the autoscaler's replacement
    done_before = max(m["step"] for m in spot.metrics())
    recovered_at = spot.wait_for_step(proc, done_before + 1)
    summary = spot.finish(proc)
    report(f"learner node lost: next step done {recovered_at - killed_at:.1f} s after the kill")

    metrics = [m for m in spot.metrics() if m["step"] > start]
    assert summary["steps"] >= STEPS_PER_LEG and metrics[-1]["step"] == start + STEPS_PER_LEG
    assert metrics[-1]["learner/restarts"] >= 1, "the learner never noticed it died"
    versions = [m["policy_version"] for m in metrics]
    assert versions == sorted(versions), f"policy versions went back: {versions}"
    assert_exactly_once(spot, start + STEPS_PER_LEG)
    assert_versions_whole(spot)


def test_losing_a_replica_node_keeps_generation_errors_from_the_learner(spot):
    import ray
    from ray import serve

    from app.fleet_client import FleetClient
    from deployments.fleet import wait_healthy

    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + 2)

    killed_at = time.time()
    spot.cluster.remove_node(spot.rollout_nodes.pop(0), allow_graceful=False)
    spot.rollout_nodes.append(spot.add_node(ROLLOUT_NODE))
    done_before = max(m["step"] for m in spot.metrics())
    step_at = spot.wait_for_step(proc, done_before + 1)
    url = f"http://127.0.0.1:{spot.port}"
    wait_healthy(url, 2, timeout_s=600)
    replaced_at = time.time()
    summary = spot.finish(proc)
    report(
        f"replica node lost: next step {step_at - killed_at:.1f} s after the kill, "
        f"replacement replica serving {replaced_at - killed_at:.1f} s after it"
    )

    assert summary["dropped_failed_total"] == 0, spot.driver_log()
    retries = spot.metrics()[-1]["rollout/request_retries_total"]
    report(f"replica node lost: {retries:.0f} generation requests retried, none failed a group")
    assert serve.status().applications["spotrl"].status == "RUNNING"
    served = {m["id"] for m in FleetClient(url).models()}
    newest = assert_versions_whole(spot)[-1]
    assert f"policy-v{newest}" in served  # the replacement reloaded the live adapters from the bucket
    assert ray.available_resources().get("rollout_node", 0) == 0  # both rollout nodes hold a replica again


def test_a_bucket_outage_stalls_the_run_and_never_leaves_a_partial_version(spot):
    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + 2)

    spot.s3.stop()
    stopped_at = time.time()
    time.sleep(10.0)
    spot.s3.start()
    back_at = time.time()
    step_at = spot.wait_for_step(proc, max(m["step"] for m in spot.metrics()) + 1)
    summary = spot.finish(proc)
    times = [m["time"] for m in spot.metrics() if m["step"] > start]
    stall = max(b - a for a, b in pairwise(times))
    report(
        f"bucket down {back_at - stopped_at:.1f} s: next step {step_at - back_at:.1f} s after it came back, "
        f"longest gap between steps {stall:.1f} s"
    )

    assert summary["steps"] >= 1 and spot.metrics()[-1]["step"] == start + STEPS_PER_LEG
    assert stall >= 8.0, "a step went through while the bucket was down: did it publish at all?"
    assert_versions_whole(spot)
    assert_exactly_once(spot, start + STEPS_PER_LEG)


def test_a_crashed_rollout_actor_restarts_and_resumes_from_the_bucket(spot):
    import ray

    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + SAVE_STEPS + 1)

    killed_at = time.time()
    ray.kill(ray.get_actor("rollout-spot", namespace="spotrl"), no_restart=False)  # a crash: Ray restarts it
    step_at = spot.wait_for_step(proc, max(m["step"] for m in spot.metrics()) + 1)
    summary = spot.finish(proc)
    report(f"rollout actor crashed: next step {step_at - killed_at:.1f} s after the kill")

    assert "rollout actor restarted: resuming at" in spot.log_path.read_text(errors="replace")
    assert summary["steps"] >= 1 and spot.metrics()[-1]["step"] == start + STEPS_PER_LEG
    assert_exactly_once(spot, start + STEPS_PER_LEG)
