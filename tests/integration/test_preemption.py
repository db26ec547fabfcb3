"""Fault injection on a spot-like Ray cluster on one machine: lose the learner's node, a replica's node, the bucket.

The cluster (`tests.support.spot_cluster`): a head (the driver's side: Serve's proxy, the ingress, the rollout
actor) and three worker nodes with the custom resources of cluster.yaml: one `learner_node`, two
`rollout_node`s, each with one vLLM replica. Everything listens on 127.0.0.1; the bucket is a real
SeaweedFS S3 server. The tests are legs of one run (one fleet, one bucket), each a
`python -m launch.train --address ...` driver that resumes where the previous one stopped, with one
fault injected in its middle, without any warning (the same with a spot notice first:
`test_spot_notices.py`). Each prints its recovery time.
"""

from __future__ import annotations

import time
from itertools import pairwise

import pytest

from tests.support.spot_cluster import (
    LEARNER_NODE,
    ROLLOUT_NODE,
    assert_exactly_once,
    assert_versions_whole,
    report,
    spot_cluster,
)

STEPS_PER_LEG = 9
SAVE_STEPS = 3  # a leg ends on a checkpoint, so the next one starts exactly there

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    with spot_cluster(tmp_path_factory.mktemp("spot"), save_steps=SAVE_STEPS) as spot:
        report(f"spot cluster: fleet of 2 replicas up in {spot.fleet_up_s:.0f} s")
        yield spot


def test_losing_the_learner_node_resumes_from_the_bucket_without_training_a_group_twice(spot):
    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + SAVE_STEPS + 1)  # past a checkpoint of this leg

    killed_at = time.time()
    spot.remove_node(spot.learner_node)  # the spot node is gone, no warning
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
    spot.remove_node(spot.rollout_nodes.pop(0))
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
