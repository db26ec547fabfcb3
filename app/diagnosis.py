"""Which side of the pipeline is the bottleneck, from the metrics a run already logs.

Asynchronous RL is a pipeline: speeding up one side buys nothing while the other lags, and a
slow stage hides everything before it (seed 003). The verdicts mirror how the seed read its
dashboard: a full queue with no rollout wait means the trainer is slow; an empty queue with a
growing wait means generation is slow; in-flight requests pinned at `max_inflight_tasks` while the
replicas have room means the client's limit, not vLLM, is what holds generation back.

Before all that, the drift alarm (the check PastAGI's article recommends: the rejection rate and the
tokens at the clip bounds rise before any quality metric moves): a `drifting` verdict when the share of
groups dropped as stale, the share of tokens at the clip bounds (`clip_ratio/region_mean`), the
per-token spread of the learner/sampler ratio (`ratio/std`) or the share of tokens GRPO's off-policy guards drop
(`off_policy/masked_share`: its token and sequence masks, `app.objectives.off_policy`) crosses its threshold
(`logging.drift`), naming the knob to turn: the staleness bound, `weight_sync_steps`, `partial_min_lag`, or a
weight sync slow against the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean


@dataclass
class Verdict:
    kind: str  # drifting | trainer-bound | generation-bound | client-bound | balanced | warming-up
    figures: dict[str, float]
    advice: str

    def __str__(self) -> str:
        figs = ", ".join(f"{k}={v:.3f}" for k, v in self.figures.items())
        what = "drift alarm" if self.kind == "drifting" else "bottleneck"
        return f"{what}: {self.kind} ({figs}) -> {self.advice}"


def diagnose(window: list[dict], cfg) -> Verdict:
    """Judge the last few steps' metrics (dicts as logged to metrics.jsonl): drifting first, else the bottleneck."""
    if len(window) < 2:
        return Verdict("warming-up", {}, "wait for a few steps")
    return drift(window, cfg) or bottleneck(window, cfg)


def _mean(window: list[dict], key: str) -> float:
    values = [m[key] for m in window if key in m]
    return mean(values) if values else 0.0


def drift(window: list[dict], cfg) -> Verdict | None:
    """`drifting` when a drift figure of the window crosses its threshold (`logging.drift`), else None."""
    limits = cfg.logging.drift
    dropped = window[-1].get("sample/dropped_stale_total", 0) - window[0].get("sample/dropped_stale_total", 0)
    taken = (len(window) - 1) * cfg.train.num_prompts_per_step  # groups trained over the same steps
    figures = {
        "dropped_stale_share": dropped / (dropped + taken) if dropped + taken else 0.0,
        "clip_share": _mean(window, "clip_ratio/region_mean"),
        "ratio_std": _mean(window, "ratio/std"),
        # Only a run whose GRPO masks something logs it; the others read 0.
        "masked_share": _mean(window, "off_policy/masked_share"),
    }
    crossed = [k for k in figures if figures[k] > getattr(limits, k)]
    if not crossed:
        return None
    return Verdict("drifting", figures, f"{', '.join(crossed)} above threshold: {drift_knob(window, cfg, crossed)}")


def drift_knob(window: list[dict], cfg, crossed: list[str]) -> str:
    """Which knob to turn: groups dropped as stale want a looser or smarter staleness bound; samples too far off
    the learner's policy want fresher ones (a faster sync, more frequent versions, earlier cuts, a tighter bound)."""
    r = cfg.rollout
    if crossed == ["dropped_stale_share"]:
        return (
            f"the staleness bound drops finished work: raise rollout.max_staleness (now {r.max_staleness}), or set "
            "rollout.staleness_rule=bound_at_admission (nothing finished is dropped) or rollout.partial_rollouts=true"
        )
    sync_s, step_s = _mean(window, "perf/weight_sync_s"), _mean(window, "perf/step_s") or 1e-9
    if sync_s / step_s > cfg.logging.drift.slow_sync_share:
        return (
            f"weight sync is slow (perf/weight_sync_s {sync_s:.2f} s against a {step_s:.2f} s step): samples wait "
            "under old versions; speed up the bucket and the fleet's load"
        )
    if cfg.learner.weight_sync_steps > 1:
        return f"lower learner.weight_sync_steps (now {cfg.learner.weight_sync_steps}): each new version is further from the last"
    if r.partial_rollouts and r.partial_min_lag > 1:
        return f"lower rollout.partial_min_lag (now {r.partial_min_lag}): generations go on that far behind"
    hard = f", rollout.hard_max_staleness (now {cfg.hard_max_staleness})" if r.staleness_rule != "drop_at_take" else ""
    return f"tighten the staleness bound: rollout.max_staleness (now {r.max_staleness}){hard}"


def bottleneck(window: list[dict], cfg) -> Verdict:
    """Which side of the pipeline holds the other back."""
    queue_fill = mean(m.get("sample/rollout_queue_size", 0) for m in window) / cfg.rollout.queue_maxsize
    inflight_fill = mean(m.get("rollout/inflight", 0) for m in window) / cfg.rollout.max_inflight_tasks
    step_s = mean(m.get("perf/step_s", 0) for m in window) or 1e-9
    wait_s = mean(m.get("perf/rollout_wait_s", 0) for m in window)
    wait_share = wait_s / (wait_s + step_s)
    # Each request asks for G sequences; a replica batches up to max_num_seqs of them.
    seqs_per_replica = (
        mean(m.get("rollout/inflight", 0) for m in window) * cfg.sampling.num_generations / cfg.fleet.num_replicas
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
            "a larger rollout.max_staleness lets generation run further ahead",
        )
    return Verdict("balanced", figures, "no single side dominates")
