"""Which side of the pipeline is the bottleneck, from the metrics a run already logs.

Asynchronous RL is a pipeline: speeding up one side buys nothing while the other lags, and a
slow stage hides everything before it (seed 003). The verdicts mirror how the seed read its
dashboard: a full queue with no rollout wait means the trainer is slow; an empty queue with a
growing wait means generation is slow; in-flight requests pinned at `max_inflight_tasks` while the
replicas have room means the client's limit, not vLLM, is what holds generation back.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean


@dataclass
class Verdict:
    kind: str  # trainer-bound | generation-bound | client-bound | balanced | warming-up
    figures: dict[str, float]
    advice: str

    def __str__(self) -> str:
        figs = ", ".join(f"{k}={v:.2f}" for k, v in self.figures.items())
        return f"bottleneck: {self.kind} ({figs}) -> {self.advice}"


def diagnose(window: list[dict], cfg) -> Verdict:
    """Judge the last few steps' metrics (dicts as logged to metrics.jsonl)."""
    if len(window) < 2:
        return Verdict("warming-up", {}, "wait for a few steps")
    queue_fill = mean(m.get("sample/rollout_queue_size", 0) for m in window) / cfg.rollout.queue_maxsize
    inflight_fill = mean(m.get("rollout/inflight", 0) for m in window) / cfg.rollout.max_inflight_tasks
    step_s = mean(m.get("perf/step_s", 0) for m in window) or 1e-9
    wait_s = mean(m.get("perf/rollout_wait_s", 0) for m in window)
    wait_share = wait_s / (wait_s + step_s)
    # Each request asks for G sequences; a replica batches up to max_num_seqs of them.
    seqs_per_replica = (
        mean(m.get("rollout/inflight", 0) for m in window) * cfg.grpo.num_generations / cfg.fleet.num_replicas
    )
    replica_fill = seqs_per_replica / cfg.fleet.max_num_seqs
    figures = {
        "queue_fill": queue_fill,
        "rollout_wait_share": wait_share,
        "inflight_fill": inflight_fill,
        "replica_fill": replica_fill,
    }
    if queue_fill >= 0.75 and wait_share < 0.1:
        return Verdict(
            "trainer-bound",
            figures,
            "speed up the learner: learner.batching=packed, a larger learner.token_budget, "
            "learner.gradient_checkpointing=false, or more learner.num_workers",
        )
    if inflight_fill >= 0.95 and replica_fill < 0.5 and queue_fill < 0.75:
        return Verdict(
            "client-bound",
            figures,
            f"raise rollout.max_inflight_tasks (now {cfg.rollout.max_inflight_tasks}); the replicas have free capacity",
        )
    if queue_fill < 0.25 and wait_share >= 0.25:
        return Verdict(
            "generation-bound",
            figures,
            "add replicas (fleet.num_replicas) or raise fleet.max_num_seqs; "
            "a larger grpo.max_staleness lets generation run further ahead",
        )
    return Verdict("balanced", figures, "no single side dominates")
