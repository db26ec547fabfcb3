"""Spot notices on a spot-like Ray cluster on one machine: each node has its own fake cloud metadata server.

The cluster of `test_preemption.py` (`tests.support.spot_cluster`: a head, one `learner_node`, two `rollout_node`s,
SeaweedFS S3), every worker node pointed at a fake AWS+GCP metadata server of its own on 127.0.0.1
(`tests.support.fake_metadata`), so a notice is posted for one node alone. The tests are legs of one run, each a
driver that resumes where the previous one stopped, with one node noticed in its middle and then killed:
- the learner's node noticed 120 s ahead (AWS), killed after two more steps;
- the learner's node noticed 30 s ahead (GCP), killed at the deadline;
- the learner sent SIGTERM (a scheduler's 30 s grace period), its node killed at the end of it;
- a replica's node noticed 35 s ahead, killed once the replacement serves: Serve begins to stop the noticed replica
  once its replacement runs or its graceful shutdown's length (30 s) before the deadline, whichever is first, and
  the replica hands its generations back then.
No step may be lost (the replacement resumes at the last step logged before the kill) and no group trained
twice; no request may fail, none be routed to the noticed replica once it drains, and its generations in
flight finish or continue elsewhere, token-exact. `learner.save_steps` is 100: only the notice's checkpoints
keep the steps. Each prints its figures: notice to checkpoint committed, kill to next step, requests failed.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.spot_cluster import assert_exactly_once, assert_versions_whole, report, spot_cluster
from tests.support.spot_legs import LONG_TOKENS, learner_leg, replica_leg

STEPS_PER_LEG = 8
NOTICE_S = 35.0  # the replica's node: Serve's graceful shutdown (30 s) begins 5 s after the notice at the latest
SPOT = (
    "spot.poll_interval_s=1",  # AWS advises 5 s; 1 s keeps the legs short. Every other spot setting: as shipped
    "model.max_model_len=256",  # room for generations long enough to be in flight when the replica goes
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    with spot_cluster(tmp_path_factory.mktemp("notices"), save_steps=100, metadata=True, extra=SPOT) as spot:
        report(f"spot cluster with a metadata server per node: fleet up in {spot.fleet_up_s:.0f} s", "notices")
        yield spot


def check_learner_leg(spot, name: str, notify, kill_after_s: float | None) -> None:
    """The leg's figures printed, then what must hold: no step lost, none trained twice, no request failed."""
    f = learner_leg(spot, STEPS_PER_LEG, notify, kill_after_s)
    learner_side = f["notice_to_checkpoint_learner_s"]
    report(
        f"{name}: notice to checkpoint committed {f['notice_to_checkpoint_s']:.1f} s (the learner's own measure "
        f"{'-' if learner_side is None else f'{learner_side:.1f}'} s); kill to next step "
        f"{f['kill_to_next_step_s']:.1f} s; resumed at step {f['resumed_step']} of {f['done_before_kill']} done; "
        f"steps abandoned {f['steps_abandoned']:.0f}, trained twice {f['steps_trained_twice']}; "
        f"requests failed {f['requests_failed']}",
        "notices",
    )
    assert f["final_step"] == f["start"] + STEPS_PER_LEG and f["restarts"] >= 1
    assert f["resumed_step"] is not None and f["resumed_step"] >= f["done_before_kill"], "a step was lost"
    assert (f["steps_trained_twice"], f["groups_trained_twice"]) == (0, 0), "the replacement trained again"
    assert_exactly_once(spot, f["start"] + STEPS_PER_LEG)
    assert_versions_whole(spot)
    assert f["requests_failed"] == 0


def test_an_aws_notice_on_the_learners_node_loses_no_step(spot):
    def notify():
        spot.metadata_of(spot.learner_node).aws_notice(in_s=120)

    check_learner_leg(spot, "learner node, AWS notice 120 s", notify, kill_after_s=None)


def test_a_gcp_notice_30_s_before_the_learners_node_goes_loses_no_step(spot):
    check_learner_leg(spot, "learner node, GCP notice 30 s", spot.metadata_of(spot.learner_node).gcp_preempt, 30.0)


def test_sigterm_to_the_learner_with_a_30_s_grace_loses_no_step(spot):
    def sigterm():
        (pid,) = spot.learner_pids()
        os.kill(pid, signal.SIGTERM)  # a scheduler stopping the job (Slurm, SkyPilot): SIGKILL 30 s later

    check_learner_leg(spot, "learner, SIGTERM with 30 s grace", sigterm, kill_after_s=30.0)


def test_a_noticed_replica_node_fails_no_request_and_hands_its_work_back(spot):
    """A notice 35 s ahead: Serve begins to stop the replica 30 s before the node goes (its graceful shutdown), or
    once the replacement runs, and the replica hands its generations back then: not `spot.handback_margin_s` before
    the deadline, which Serve's stop would pre-empt whenever a replacement runs early."""
    from core.config import SpotConfig

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
