"""The learner on a node of its own still tells the fleet of each new version, without an address of the fleet's.

In a cluster the fleet's HTTP proxy listens on the head at fleet.host, an address as the head sees it:
127.0.0.1 there (the default) is, on the learner's node, the learner's node itself. One machine has
one loopback, so here the head's own address is played by 127.0.0.2 (all of 127.0.0.0/8 is
loopback): the fleet listens there, while the run's config says 127.0.0.1, as it does by default.
A process that takes fleet.host at its word reaches nothing, as a process on another node would.

A loopback `ray.cluster_utils.Cluster` has a head (Serve's proxy, the ingress, the driver's side),
a `learner_node` and a `rollout_node` with one vLLM replica; the fleet is up before the run, with an
empty bucket, so that its replica holds no version it did not hear of. The test then runs the driver
for two steps and checks that every version the learner published reached the replica by the
learner's own broadcast: no failed fleet load in the learner's metrics, and policy-v0 not loaded by
the driver's fallback (`ensure_served`). A replica asked for a version it lacks loads it from the
bucket by itself, so the run's samples alone would not tell whether the broadcast arrived.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.local_ray import SINGLE_MACHINE_ENV

REPO = Path(__file__).resolve().parents[2]
HEAD_LOOPBACK = "127.0.0.2"  # the head's own 127.0.0.1, as nothing on another node can reach it
STEPS = 2


def _overrides(tmp: Path, port: int) -> list[str]:
    # No task.* or tiny.* setting: those name another tiny model, which the driver would warm up for minutes.
    return [
        "logging.run_name=cross",
        f"logging.output_dir={tmp}",
        "logging.progress_bar=false",
        "logging.report_to=[jsonl, ray]",
        f"bucket.url=file://{tmp}/bucket",
        f"bucket.cache_dir={tmp}/cache",
        f"fleet.port={port}",
        "fleet.num_replicas=1",
        "fleet.replica_resources={rollout_node: 1}",
        "learner.ray_resources={learner_node: 1}",
        "learner.save_steps=100",
        "train.num_prompts_per_step=4",
        f"train.max_steps={STEPS}",
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_path):
    """Head + learner node + rollout node on loopback, with the fleet up on the head's address."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from core.config import load_config
    from core.local_ray import loopback_system_config, single_machine_mode
    from deployments.fleet import deploy_fleet
    from tests.support.fleet_helpers import free_port

    tmp = tmp_path_factory.mktemp("cross")
    overrides = _overrides(tmp, free_port())
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 * 2**20}
    head = {**node, "num_cpus": 1, "include_dashboard": False, "_system_config": loopback_system_config()}
    with single_machine_mode():
        ray_cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            ray_cluster.add_node(**node, num_cpus=1, resources={"learner_node": 1})
            ray_cluster.add_node(**node, num_cpus=1, resources={"rollout_node": 1})
            ray.init(address=ray_cluster.address)
            # What `make serve` does on the head of a cluster: the proxy listens at the head's address.
            deploy_fleet(load_config(None, [*overrides, f"fleet.host={HEAD_LOOPBACK}"]).own_fleet(), tiny_model_path)
            yield ray_cluster, tmp, overrides
        finally:
            serve.shutdown()
            ray.shutdown()
            ray_cluster.shutdown()


def test_the_learner_on_another_node_loads_each_version_on_the_fleet_itself(cluster):
    from app.fleet_client import FleetClient
    from core.config import load_config
    from deployments.fleet import fleet_url

    ray_cluster, tmp, overrides = cluster
    log_path = tmp / "driver.log"
    args = [a for s in overrides for a in ("--set", s)]
    with open(log_path, "w") as out:
        rc = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.train",
                "--config",
                "configs/tiny-cpu.yaml",
                "--address",
                ray_cluster.address,
            ]
            + args,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SINGLE_MACHINE_ENV},
            timeout=600,
        ).returncode
    log = log_path.read_text(errors="replace")
    assert rc == 0, log[-6000:]

    metrics = [json.loads(line) for line in (tmp / "cross" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # Every version the learner published (policy-v1, policy-v2) was loaded by its broadcast, none missed.
    assert [m["weight_sync/fleet_load_failures"] for m in metrics] == [0.0] * STEPS, log[-6000:]
    # policy-v0, published at the learner's start, too: the driver found it served and had nothing to load.
    assert "does not serve policy-v0 yet" not in log, log[-6000:]
    assert "fleet did not load" not in log, log[-6000:]
    # The learner was handed no HTTP address: on one machine any of the head's would reach, on a cluster not.
    assert "the learner tells the fleet of new versions through serve://spotrl" in log
    url = fleet_url(load_config(None, overrides))  # Serve's own address: the head's, not the config's
    assert url.startswith(f"http://{HEAD_LOOPBACK}:")
    assert f"policy-v{metrics[-1]['policy_version']}" in {m["id"] for m in FleetClient(url).models()}
