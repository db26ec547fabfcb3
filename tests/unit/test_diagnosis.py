"""Bottleneck verdicts from the figures the seed read off its dashboard."""

from app.config import load_config
from app.diagnosis import diagnose

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
