"""Bottleneck verdicts from the figures the seed read off its dashboard."""

from app.diagnosis import diagnose
from core.config import load_config

CFG = load_config(None, ["rollout.queue_maxsize=16", "rollout.max_inflight_tasks=16", "fleet.max_num_seqs=256"])


def window(queue, inflight, wait_s, step_s=1.0, n=4):
    return [
        {
            "sample/rollout_queue_size": queue,
            "rollout/inflight": inflight,
            "perf/rollout_wait_s": wait_s,
            "perf/step_s": step_s,
        }
    ] * n


def test_full_queue_and_no_wait_is_trainer_bound():
    v = diagnose(window(queue=16, inflight=16, wait_s=0.01), CFG)
    assert v.kind == "trainer-bound" and "learner" in v.advice and v.figures["queue_fill"] == 1.0


def test_empty_queue_and_long_wait_is_generation_bound():
    v = diagnose(window(queue=0, inflight=4, wait_s=2.0), CFG)
    assert v.kind == "generation-bound" and "fleet.num_replicas" in v.advice


def test_inflight_pinned_with_idle_replicas_is_client_bound():
    v = diagnose(window(queue=2, inflight=16, wait_s=1.0), CFG)
    assert v.kind == "client-bound" and "max_inflight_tasks" in v.advice
    busy = load_config(None, ["rollout.queue_maxsize=16", "rollout.max_inflight_tasks=16", "fleet.max_num_seqs=64"])
    assert diagnose(window(queue=2, inflight=16, wait_s=1.0), busy).kind != "client-bound"  # replicas are full


def test_too_few_steps_is_no_verdict():
    assert diagnose(window(16, 16, 0.0, n=1), CFG).kind == "warming-up"
    assert "bottleneck:" in str(diagnose(window(16, 16, 0.0), CFG))


def healthy(n=4, **extra):
    """Steps of a healthy tiny run (trainer-bound), each with `extra` on top."""
    return [{**window(queue=16, inflight=16, wait_s=0.01)[0], "clip_ratio/region_mean": 0.014, **extra}] * n


def test_a_healthy_run_raises_no_alarm():
    steps = healthy(**{"ratio/std": 0.05, "clip_ratio/region_mean": 0.10})  # the tiny run's worst clip share
    assert diagnose(steps, CFG).kind == "trainer-bound"


def test_groups_dropped_as_stale_name_the_staleness_bound():
    # 16 groups trained per step, 3 more dropped each step: 15.8% of what was taken or dropped.
    steps = [{**healthy(1)[0], "sample/dropped_stale_total": 3 * k} for k in range(4)]
    v = diagnose(steps, CFG)
    assert v.kind == "drifting" and str(v).startswith("drift alarm: drifting")
    assert v.figures["dropped_stale_share"] == 9 / (9 + 48)
    assert "rollout.max_staleness" in v.advice and "bound_at_admission" in v.advice
    quiet = [{**healthy(1)[0], "sample/dropped_stale_total": k // 2} for k in range(4)]  # 1 in 49: below 5%
    assert diagnose(quiet, CFG).kind != "drifting"


def test_clipped_tokens_or_a_wide_ratio_name_the_knob_that_makes_samples_stale():
    clipped = healthy(**{"clip_ratio/region_mean": 0.3})
    v = diagnose(clipped, CFG)
    assert v.kind == "drifting" and "clip_share" in v.advice and "tighten the staleness bound" in v.advice
    spread = healthy(**{"ratio/std": 0.9})
    assert "ratio_std" in diagnose(spread, CFG).advice
    slow = healthy(**{"ratio/std": 0.9, "perf/weight_sync_s": 0.8})  # against a 1 s step
    assert "weight sync is slow" in diagnose(slow, CFG).advice
    every_4 = load_config(None, ["learner.weight_sync_steps=4"])
    assert "learner.weight_sync_steps (now 4)" in diagnose(spread, every_4).advice
    lagging = load_config(None, ["rollout.partial_rollouts=true", "rollout.partial_min_lag=3"])
    assert "rollout.partial_min_lag (now 3)" in diagnose(spread, lagging).advice
    admitted = load_config(None, ["rollout.staleness_rule=bound_at_admission"])
    assert "rollout.hard_max_staleness" in diagnose(clipped, admitted).advice


def test_thresholds_are_configurable():
    strict = load_config(None, ["logging.drift.clip_share=0.01"])
    assert diagnose(healthy(), strict).kind == "drifting"
    lax = load_config(None, ["logging.drift.ratio_std=5"])
    assert diagnose(healthy(**{"ratio/std": 0.9}), lax).kind != "drifting"


def test_tokens_the_off_policy_masks_drop_raise_the_alarm():
    masked = healthy(**{"off_policy/masked_share": 0.3})
    v = diagnose(masked, CFG)
    assert v.kind == "drifting" and "masked_share" in v.advice and v.figures["masked_share"] == 0.3
    assert diagnose(healthy(**{"off_policy/masked_share": 0.02}), CFG).kind != "drifting"
    assert diagnose(masked, load_config(None, ["logging.drift.masked_share=0.5"])).kind != "drifting"
