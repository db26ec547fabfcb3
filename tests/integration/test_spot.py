"""Node losses on a spot-like Ray cluster on one machine, first without any warning, then with a spot notice first.

The cluster (`tests.support.spot_cluster`): a head (the driver's side: Serve's proxy, the ingress, the rollout
actor) and three worker nodes with the custom resources of cluster.yaml: one `learner_node`, two
`rollout_node`s, each with one vLLM replica, every worker node pointed at a fake AWS+GCP metadata server of its own
on 127.0.0.1 (`tests.support.fake_metadata`), so a notice is posted for one node alone. Everything listens on
127.0.0.1; the bucket is a real SeaweedFS S3 server. One cluster for the module: the tests are legs of one run (one
fleet, one bucket), each a `python -m launch.train --address ...` driver that resumes where the previous one
stopped, with one fault injected in its middle. Each prints its figures.

Without a notice (`learner.save_steps` 3: a leg ends on a checkpoint, so the next one starts exactly there): the
learner's node lost, a replica's node lost, the bucket down for 10 s, the rollout actor crashed.

With a notice (`learner.save_steps` 100: only the notice's checkpoints keep the steps):
- the learner's node noticed 120 s ahead (AWS), killed after two more steps;
- the learner's node noticed 30 s ahead (GCP), killed at the deadline (slow: `make test-all`);
- the learner sent SIGTERM (a scheduler's 30 s grace period), its node killed at the end of it (slow);
- a replica's node noticed 32 s ahead, killed once the replacement serves: Serve begins to stop the noticed replica
  once its replacement runs or its graceful shutdown's length (30 s) before the deadline, whichever is first, and
  the replica hands its generations back then. The fleet serves a judge deployment beside the base model (one
  replica on each rollout node, `FleetConfig.judge`): the judge's replica on that node hands its generations back as
  well, and another judge replica answers them.
No step may be lost (the replacement resumes at the last step logged before the kill) and no group trained
twice; no request may fail, none be routed to the noticed replica once it drains, and its generations in
flight finish or continue elsewhere, token-exact.
"""

from __future__ import annotations

import os
import signal
import time
from itertools import pairwise

import pytest

from tests.support.spot_cluster import (
    LEARNER_NODE,
    assert_exactly_once,
    assert_versions_whole,
    report,
    spot_cluster,
)
from tests.support.spot_legs import LONG_TOKENS, ON_NODE_N, ON_NODE_PROMPTS, learner_leg, replica_leg

STEPS_PER_LEG = 9  # without a notice
SAVE_STEPS = 3
NOTICE_STEPS_PER_LEG = 8  # with one
NOTICE_SAVE_STEPS = 100
# The replica's node: Serve's graceful shutdown (30 s) begins 2 s after the notice is heard, at the latest. Short, so
# that the noticed replica's long generations still run then (at 35 s they had finished in about 1 run of 3).
NOTICE_S = 32.0
SPOT = (
    "spot.poll_interval_s=1",  # AWS advises 5 s; 1 s keeps the legs short. Every other spot setting: as shipped
    "model.max_model_len=256",  # room for generations long enough to be in flight when the replica goes
)


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    with spot_cluster(
        tmp_path_factory.mktemp("spot"), save_steps=SAVE_STEPS, metadata=True, extra=SPOT, judge=True
    ) as spot:
        report(
            f"spot cluster with a metadata server per node: fleet of 2 replicas and a judge deployment of 2 up in "
            f"{spot.fleet_up_s:.0f} s"
        )
        yield spot


# ---- without a notice ---------------------------------------------------------------------------------------


def test_losing_the_learner_node_resumes_from_the_bucket_without_training_a_group_twice(spot):
    spot.save_steps = SAVE_STEPS
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

    spot.save_steps = SAVE_STEPS
    start = spot.resume_step()
    proc = spot.start_driver(start + STEPS_PER_LEG)
    spot.wait_for_step(proc, start + 2)

    killed_at = time.time()
    spot.remove_node(spot.rollout_nodes.pop(0))
    spot.rollout_nodes.append(spot.add_node(spot.rollout_resources))
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
    spot.save_steps = SAVE_STEPS
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

    spot.save_steps = SAVE_STEPS
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


# ---- with a notice ------------------------------------------------------------------------------------------


def check_learner_leg(spot, name: str, notify, kill_after_s: float | None) -> None:
    """The leg's figures printed, then what must hold: no step lost, none trained twice, no request failed."""
    spot.save_steps = NOTICE_SAVE_STEPS
    f = learner_leg(spot, NOTICE_STEPS_PER_LEG, notify, kill_after_s)
    learner_side = f["notice_to_checkpoint_learner_s"]
    report(
        f"{name}: notice to checkpoint committed {f['notice_to_checkpoint_s']:.1f} s (the learner's own measure "
        f"{'-' if learner_side is None else f'{learner_side:.1f}'} s); kill to next step "
        f"{f['kill_to_next_step_s']:.1f} s; resumed at step {f['resumed_step']} of {f['done_before_kill']} done; "
        f"steps abandoned {f['steps_abandoned']:.0f}, trained twice {f['steps_trained_twice']}; "
        f"requests failed {f['requests_failed']}",
        "notices",
    )
    assert f["final_step"] == f["start"] + NOTICE_STEPS_PER_LEG and f["restarts"] >= 1
    assert f["resumed_step"] is not None and f["resumed_step"] >= f["done_before_kill"], "a step was lost"
    assert (f["steps_trained_twice"], f["groups_trained_twice"]) == (0, 0), "the replacement trained again"
    assert_exactly_once(spot, f["start"] + NOTICE_STEPS_PER_LEG)
    assert_versions_whole(spot)
    assert f["requests_failed"] == 0


def test_an_aws_notice_on_the_learners_node_loses_no_step(spot):
    def notify():
        spot.metadata_of(spot.learner_node).aws_notice(in_s=120)

    check_learner_leg(spot, "learner node, AWS notice 120 s", notify, kill_after_s=None)


# The GCP notice and the scheduler's SIGTERM reach the learner's checkpoint by the same path as the AWS notice (after
# its own watcher), each a leg of a minute: in `make test-all`, not CI's `make test`; `tests/unit/contracts/
# test_notices.py` covers each watcher's reading of its notice.
@pytest.mark.slow
def test_a_gcp_notice_30_s_before_the_learners_node_goes_loses_no_step(spot):
    check_learner_leg(spot, "learner node, GCP notice 30 s", spot.metadata_of(spot.learner_node).gcp_preempt, 30.0)


@pytest.mark.slow
def test_sigterm_to_the_learner_with_a_30_s_grace_loses_no_step(spot):
    def sigterm():
        (pid,) = spot.learner_pids()
        os.kill(pid, signal.SIGTERM)  # a scheduler stopping the job (Slurm, SkyPilot): SIGKILL 30 s later

    check_learner_leg(spot, "learner, SIGTERM with 30 s grace", sigterm, kill_after_s=30.0)


def test_a_noticed_replica_node_fails_no_request_and_hands_its_work_back(spot):
    """A notice 32 s ahead: Serve begins to stop the replica 30 s before the node goes (its graceful shutdown), or
    once the replacement runs, and the replica hands its generations back then: not `spot.handback_margin_s` before
    the deadline, which Serve's stop would pre-empt whenever a replacement runs early."""
    from core.config import SpotConfig

    spot.save_steps = NOTICE_SAVE_STEPS
    f = replica_leg(spot, notice_in_s=NOTICE_S)
    report(
        f"replica node, AWS notice: router routed around it {f['notice_to_routed_around_s']:.1f} s after the notice "
        f"({f['routed_at_drain'] - f['routed_at_notice']} routed in between; refused while draining and sent "
        f"elsewhere: {f['refused_draining']}); routed to it after that: {f['routed_after_drain']}; generations "
        f"handed back and continued elsewhere: {f['handed_back']} ({f['notice_to_handed_back_s'] or float('nan'):.1f} s after the notice); requests failed: {f['long_requests_failed']} of "
        f"{f['long_requests']} long ones, {f['requests_failed']} groups of the run; replacement serving "
        f"{f['notice_to_replacement_serving_s']:.0f} s after the notice, before the node went; kill to next step "
        f"{f['kill_to_next_step_s']:.1f} s",
        "notices",
    )
    assert f["replicas_on_node"] == 1
    assert f["long_requests_failed"] == 0 and f["requests_failed"] == 0
    assert f["routed_after_drain"] == 0, "a request was routed to the draining replica"
    assert f["handed_back"] >= 1, "nothing was in flight at the hand-back: the test proves nothing"
    assert f["notice_to_handed_back_s"] < 30.0 - SpotConfig().handback_margin_s, (
        "handed back at the margin, not Serve's stop"
    )
    choices = f["long_choices"]
    assert all(len(c["token_ids"]) == LONG_TOKENS == len(c["logprobs"]["token_logprobs"]) for c in choices)
    assert all(c["finish_reason"] == "length" for c in choices)

    # The judge deployment's replica on the node (issue 48): its generations handed back, answered by another judge
    # replica, whole, and none failed.
    judged = f["judge_replicas_on_node"]
    assert len(judged) == 1, f"the noticed node holds judge replicas {judged}, not one"
    continued = [by.split(",") for by in f["judge_answered_by"] if by.startswith(judged[0]) and "," in by]
    report(
        f"replica node, AWS notice: judge requests answered by the noticed judge replica and continued on another: "
        f"{len(continued)} of {f['judge_requests']}, failed: {f['judge_requests_failed']}",
        "notices",
    )
    assert f["judge_requests_failed"] == 0 and f["judge_requests"] == ON_NODE_PROMPTS
    assert f["judge_routed_after_drain"] == 0, "a judge request was routed to the draining judge replica"
    assert continued, f"no judge request was handed back: {f['judge_answered_by']}"
    assert all(judged[0] not in rest for _, *rest in continued), "continued on the noticed judge replica"
    choices = f["judge_choices"]
    assert len(choices) == ON_NODE_PROMPTS * ON_NODE_N
    assert all(len(c["token_ids"]) == LONG_TOKENS == len(c["logprobs"]["token_logprobs"]) for c in choices)
    assert all(c["finish_reason"] == "length" for c in choices)
