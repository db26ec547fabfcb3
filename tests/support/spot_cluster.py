"""A spot-like Ray cluster on one machine, for the fault tests (`tests/integration/test_spot.py`) and the preemption
benchmark (`bench/preemption.py`).

`ray.cluster_utils.Cluster` starts a head (the driver's side: Serve's proxy, the ingress, the rollout
actor) and worker nodes with the custom resources of cluster.yaml: one `learner_node`, two
`rollout_node`s, each with one vLLM replica (and one of a judge deployment's, when asked for). Everything listens
on 127.0.0.1; the bucket is a real SeaweedFS S3 server. Each worker node may get its own fake cloud metadata server (`tests.support.fake_metadata`,
pointed at through the node's raylet environment, which its workers inherit): a test posts a notice for that
node alone. The run goes in legs, each a `python -m launch.train --address ...` driver that resumes where the
previous one stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from contracts.serving import REPLICA_DEPLOYMENT
from core.local_ray import SINGLE_MACHINE_ENV
from tests.support import REPO
from tests.support.fake_metadata import FakeMetadata
from tests.support.s3_server import S3Server, free_base_port

CONFIG = "configs/tiny-cpu.yaml"
LEARNER_NODE = {"learner_node": 1}
ROLLOUT_NODE = {"rollout_node": 1}
JUDGE_MODEL = "judge"  # the name requests give the judge deployment, when the fleet serves one
# Ray advertises the machine's outward address unless told that this is a one-machine "cluster" (core/local_ray.py).
LOOPBACK_ENV = SINGLE_MACHINE_ENV
PYTEST = {}  # pytest's config, when under pytest (tests/conftest.py): `report` writes past its capture


def report(line: str, tag: str = "preemption") -> None:
    """Print a figure; under pytest past its capture too: recovery times belong in `make test`'s output."""
    print(line)
    config = PYTEST.get("config")
    if config is None:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    terminal = config.pluginmanager.getplugin("terminalreporter")
    with capture.global_and_fixture_disabled():
        terminal.write_line(f"[{tag}] {line}")


class SpotCluster:
    """The cluster, its S3 server and the run's settings, with the faults the tests inject."""

    def __init__(
        self,
        tmp: Path,
        s3: S3Server,
        *,
        save_steps: int,
        metadata: bool = False,
        extra: tuple = (),
        judge: bool = False,
    ):
        from ray.cluster_utils import Cluster

        from core.local_ray import loopback_system_config
        from tests.support.fleet_helpers import free_port

        self.tmp, self.s3, self.save_steps, self.extra = tmp, s3, save_steps, list(extra)
        self.judge = judge  # the fleet serves a judge deployment too, a replica of it on each rollout node
        # A judge's replica asks for a rollout node's resource as the base model's does (`FleetConfig.deployment_fleet`).
        self.rollout_resources = {"rollout_node": 2} if judge else ROLLOUT_NODE
        self.bucket = s3.make_bucket("spot") + "/run"
        self.port = free_port()
        self.with_metadata = metadata
        self.metadata: dict[str, FakeMetadata] = {}  # a node's fake metadata server, by the node's unique id
        self.drivers: list[subprocess.Popen] = []  # every driver started: one a failed test left running is killed
        node = {"node_ip_address": "127.0.0.1", "object_store_memory": 150 * 2**20}
        # Loopback only, as `make train`'s Ray (core/local_ray.py); the system config reaches every node through the GCS.
        head = {**node, "num_cpus": 2, "include_dashboard": False, "_system_config": loopback_system_config()}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._node_args = node
        self.learner_node = self.add_node(LEARNER_NODE, num_cpus=2)
        self.rollout_nodes = [self.add_node(self.rollout_resources) for _ in range(2)]

    def add_node(self, resources: dict, num_cpus: int = 1):
        env = {}
        if self.with_metadata:
            fake = FakeMetadata().__enter__()
            env = fake.env()
        node = self.cluster.add_node(**self._node_args, num_cpus=num_cpus, resources=resources, env_vars=env)
        if self.with_metadata:
            self.metadata[node.unique_id] = fake
        return node

    def remove_node(self, node) -> None:
        """The node is gone, at once (a spot machine taken back); a node that ended by itself is forgotten."""
        with contextlib.suppress(Exception):  # a drained idle raylet may have exited already
            self.cluster.remove_node(node, allow_graceful=False)
        fake = self.metadata.pop(node.unique_id, None)
        if fake is not None:
            fake.__exit__(None, None, None)

    def metadata_of(self, node) -> FakeMetadata:
        return self.metadata[node.unique_id]

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
            "logging.report_to=[jsonl, ray]",
            f"bucket.url={self.bucket}",
            f"bucket.endpoint_url={self.s3.endpoint_url}",
            f"bucket.cache_dir={self.tmp}/cache",
            f"fleet.port={self.port}",
            "fleet.replica_resources={rollout_node: 1}",
            "learner.ray_resources={learner_node: 1}",
            f"learner.save_steps={self.save_steps}",
            "task.num_heldout=32",
            *self.extra,
        ]

    def config(self):
        """What each driver runs (`start_driver`), so the fleet serves the base model the drivers train."""
        from core.config import load_config

        return load_config(REPO / CONFIG, self.overrides())

    def deploy_fleet(self) -> float:
        """The fleet of two replicas (one per rollout node), and a judge deployment of two beside it if asked for (the
        base model's folder, as `configs/tiny-judge.yaml`'s judge is the base model); seconds it took."""
        from core.config import FleetConfig
        from deployments.fleet import deploy_fleet
        from tiny.build import prepare_model

        t0 = time.time()
        cfg = self.config()  # task.num_heldout=32: a tiny model of its own (its warm-up never sees those 32)
        model_path = prepare_model(cfg.model, cfg.task)
        fleet = cfg.own_fleet()
        if self.judge:
            model = cfg.model.model_copy(update={"name_or_path": model_path}).model_dump()
            judge = {"name": JUDGE_MODEL, "model": model, "num_replicas": 2}
            fleet = FleetConfig.model_validate({**fleet.model_dump(), "judge": judge})
        deploy_fleet(fleet, model_path)
        return time.time() - t0

    def resume_step(self) -> int:
        from core.bucket.store import CheckpointStore

        return CheckpointStore.from_config(self.config()).latest() or 0

    def newest_version(self) -> int:
        from core.bucket.store import AdapterStore

        return max(AdapterStore.from_config(self.config()).versions())

    def checkpoints(self) -> list[int]:
        from core.bucket.store import CheckpointStore

        return CheckpointStore.from_config(self.config()).steps()

    def start_driver(self, max_steps: int) -> subprocess.Popen:
        args = [a for s in [*self.overrides(), f"train.max_steps={max_steps}"] for a in ("--set", s)]
        self.log_path = self.tmp / f"driver-{max_steps}.log"
        driver = subprocess.Popen(
            [sys.executable, "-m", "launch.train", "--config", CONFIG, "--address", self.address, *args],
            cwd=REPO,
            stdout=open(self.log_path, "w"),  # noqa: SIM115 - the driver writes to it until it ends
            stderr=subprocess.STDOUT,
            env={**os.environ, **LOOPBACK_ENV},
        )
        self.drivers.append(driver)
        return driver

    def driver_log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def last_step(self) -> int:
        return max((m["step"] for m in self.metrics()), default=0)

    def wait_for_step(self, proc, step: int, timeout_s: float = 600) -> float:
        """Block until the run logged `step`; returns when that happened (time.time())."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.last_step() >= step:
                return time.time()
            assert proc.poll() is None, f"the driver ended early:\n{self.driver_log()}"
            time.sleep(0.5)
        raise AssertionError(f"step {step} not reached in {timeout_s:.0f} s:\n{self.driver_log()}")

    def wait_for_checkpoint(self, newer_than: int, timeout_s: float = 300) -> tuple[int, float]:
        """Block until a checkpoint above step `newer_than` is committed; (its step, when it was seen)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            steps = [s for s in self.checkpoints() if s > newer_than]
            if steps:
                return max(steps), time.time()
            time.sleep(0.2)
        raise AssertionError(f"no checkpoint after step {newer_than} within {timeout_s:.0f} s:\n{self.driver_log()}")

    def finish(self, proc, timeout_s: float = 900) -> dict:
        rc = proc.wait(timeout_s)
        assert rc == 0, self.driver_log()
        return json.loads((self.run_dir / "summary.json").read_text())

    def stop_driver(self, proc, timeout_s: float = 300) -> dict:
        """End a driver early as a scheduler would (SIGTERM: it checkpoints after the step under way and exits 0,
        `app.spot`); the metrics of its last step."""
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout_s)
        assert rc == 0 and "was preempted" in self.driver_log(), self.driver_log()
        return self.metrics()[-1]

    def learner_pids(self) -> list[int]:
        """The learner ranks' processes (Ray titles its workers `ray::<class>`)."""
        import psutil

        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if cmdline.startswith("ray::LearnerRankActor"):
                found.append(proc.pid)
        return found

    def replicas_on(self, node, deployment: str = REPLICA_DEPLOYMENT) -> set[str]:
        """The Serve replica ids of `deployment` (the base model's, or a judge's or teacher's) that run on `node`."""
        from ray._private.state import actors  # the GCS's table: this cluster runs no dashboard for the state API

        alive = actors(actor_state_name="ALIVE").values()
        on_node = [a["Name"] for a in alive if a["Address"]["NodeID"] == node.node_id]
        # Serve names a replica's actor SERVE_REPLICA::<app>#<deployment>#<replica id>.
        names = [name.rsplit("#", 2) for name in on_node if name.startswith("SERVE_REPLICA::")]
        return {replica for _, name, replica in names if name == deployment}

    def shutdown(self) -> None:
        import ray
        from ray import serve

        # A driver that a failed test never stopped would go on training against a cluster torn down under it,
        # and take the CPU from the modules after this one (on CI, their fleets' start-up timed out).
        for driver in self.drivers:
            if driver.poll() is None:
                driver.kill()
                driver.wait(60)
        serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()
        for fake in self.metadata.values():
            fake.__exit__(None, None, None)
        self.metadata.clear()


@contextlib.contextmanager
def spot_cluster(tmp: Path, *, save_steps: int, metadata: bool = False, extra: tuple = (), judge: bool = False):
    """A SpotCluster with its S3 server and its fleet deployed, connected to this process's Ray; torn down after."""
    import ray

    from core.local_ray import single_machine_mode

    s3 = S3Server(tmp / "s3", free_base_port()).start()  # fixed ports: it comes back where it was
    saved_env = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())  # the nodes (started next) and the drivers inherit the credentials
    spot = None
    # Ray's one-machine mode (what LOOPBACK_ENV does for the drivers) for this process and every node it
    # starts, now and when a test replaces one: all of them listen on 127.0.0.1 only.
    with single_machine_mode():
        try:
            spot = SpotCluster(tmp, s3, save_steps=save_steps, metadata=metadata, extra=extra, judge=judge)
            ray.init(address=spot.address)
            spot.fleet_up_s = spot.deploy_fleet()
            yield spot
        finally:
            if spot is not None:
                spot.shutdown()
            s3.kill()
            for k, v in saved_env.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


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


def retrained(trained_log: Path, after_step: int = 0) -> tuple[int, int]:
    """(steps, groups) trained more than once past `after_step`: what a lost learner trained and its replacement
    trained again (each line of the log is one step as it happened)."""
    seen_steps: dict[int, int] = {}
    seen_groups: dict[str, int] = {}
    for line in trained_log.read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] <= after_step:
            continue
        seen_steps[rec["step"]] = seen_steps.get(rec["step"], 0) + 1
        for g in rec["groups"]:
            seen_groups[str(g)] = seen_groups.get(str(g), 0) + 1
    return sum(n - 1 for n in seen_steps.values()), sum(n - 1 for n in seen_groups.values())


def assert_exactly_once(spot: SpotCluster, final_step: int) -> None:
    steps = lineage(spot.run_dir / "trained_groups.jsonl")
    assert sorted(steps) == list(range(1, final_step + 1))
    ids = [g for groups in steps.values() for g in groups]
    assert len(ids) == len(set(ids)), "a group was trained twice"


def assert_versions_whole(spot: SpotCluster) -> list[int]:
    """Every committed version downloads and matches its manifest's checksums; none is missing."""
    from core.bucket.store import AdapterStore

    store = AdapterStore.from_config(spot.config())
    versions = sorted(store.versions())
    for v in versions:
        store.fetch(v)  # raises IntegrityError on a partial or corrupt version
    assert versions == list(range(versions[0], versions[-1] + 1)), versions
    return versions
