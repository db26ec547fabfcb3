"""What a run records: its numbers step by step (metrics, the audit trail of trained groups, the progress bar,
the verdicts) and the summary at the end, so that the loop and the summary read the same figures.

A run resumed after a spot notice or a crash is one run: its summary counts the steps the earlier processes
trained too, read back from `metrics.jsonl` (`previous_steps`); only the timings (loop, idle shares, wall time)
are the finishing process's own."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from app.messages import RolloutStats, StepResult
from app.periodic_eval import EvalPoint
from core.config import RunConfig


def window_mean(values: list[float], share: float, last: bool) -> float | None:
    if not values:
        return None
    k = max(1, round(len(values) * share))
    chunk = values[-k:] if last else values[:k]
    return statistics.fmean(chunk)


class Run:
    """The numbers of one training run, so the loop and the summary read the same ones."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.history: list[dict] = []
        self.own_from = 0  # history[own_from:] are this process's steps, the rest an earlier process's (`restore`)
        self.stale_sum, self.stale_groups, self.stale_max = 0, 0, None  # of the trained groups' staleness
        self.samples_trained = 0
        self.partial_samples = 0  # trained samples whose tokens span more than one version
        self.t0 = time.time()
        self.loop_t0: float | None = None  # start of the training loop, after start-up and the first evaluation
        self.loop_s = 0.0
        self.idle_at_loop_start = 0.0
        self.teacher_heldout: dict | None = None  # a distilling run's teacher, evaluated as the student is
        self.teachers_heldout: dict[str, dict] = {}  # of several teachers, each so evaluated, by name
        self.eval_points: list[EvalPoint] = []  # the evaluation curve during training (`app.periodic_eval`)

    def start_loop(self, rollout_stats: RolloutStats) -> None:
        self.loop_t0 = time.time()
        self.idle_at_loop_start = rollout_stats.idle_s

    def end_loop(self) -> None:
        self.loop_s = time.time() - self.loop_t0

    def record(
        self,
        result: StepResult,
        rollout_stats: RolloutStats,
        rollout_wait_s: float,
        evaluated: Sequence[EvalPoint] = (),
        eval_counts: dict[str, int] | None = None,
    ) -> dict:
        """The step's metrics as logged: the learner's, the rollout's, its groups', how long we waited for them, and
        the evaluation during training that landed meanwhile (the newest, if several: each joins the curve)."""
        metrics = {
            **result.metrics,
            "policy_version": result.policy_version,
            **rollout_stats.metrics(),
            **(result.batch.metrics() if result.batch else {}),
            "perf/rollout_wait_s": rollout_wait_s,
            **(evaluated[-1].metrics() if evaluated else {}),
            **(eval_counts or {}),
        }
        self.eval_points.extend(evaluated)
        self.history.append(metrics)
        if result.batch:
            batch = result.batch
            self.samples_trained += batch.num_samples
            self.partial_samples += batch.num_partial
            if batch.staleness:
                self.stale_sum += sum(batch.staleness)
                self.stale_groups += len(batch.staleness)
                self.stale_max = max(self.stale_max or 0, max(batch.staleness))
        return metrics

    def restore(self, records: list[dict]) -> None:
        """The steps an earlier process of this run trained (`previous_steps`), counted as if recorded here."""
        for m in records:
            samples = int(m.get("samples", 0))
            self.samples_trained += samples
            self.partial_samples += round(m.get("sample/partial_share", 0.0) * samples)
            if groups := int(m.get("sample/groups", 0)):  # the step's mean and max are what the summary needs
                self.stale_sum += m["sample/staleness_mean"] * groups
                self.stale_groups += groups
                self.stale_max = max(self.stale_max or 0, int(m["sample/staleness_max"]))
        self.history = records + self.history
        self.eval_points = [p for m in records if (p := EvalPoint.from_metrics(m))] + self.eval_points
        self.own_from += len(records)

    def summary(self, before: dict | None, after: dict | None, rollout: RolloutStats, router: dict | None) -> dict:
        rewards = [m["reward"] for m in self.history if "reward" in m]
        ratios = [m["ratio"] for m in self.history if "ratio" in m]
        return {
            "run_name": self.cfg.logging.run_name,
            "fleet_run": self.cfg.fleet_run,  # its name on the shared fleet it joined, else None
            "steps": len(self.history),
            "samples_trained": self.samples_trained,
            "policy_version": self.history[-1].get("policy_version") if self.history else None,
            "reward_first_10pct": window_mean(rewards, 0.1, last=False),
            "reward_last_10pct": window_mean(rewards, 0.1, last=True),
            "heldout_accuracy_before": before and before["accuracy"],
            "heldout_accuracy_after": after and after["accuracy"],
            "heldout_models": [before and before["model"], after and after["model"]],
            # Held-out episodes the environment lost, scored unsolved (the evaluation's `lost`).
            "heldout_lost_before": before and before.get("lost"),
            "heldout_lost_after": after and after.get("lost"),
            "heldout_accuracy_by_dataset_before": before and before.get("accuracy_by_dataset"),
            "heldout_accuracy_by_dataset_after": after and after.get("accuracy_by_dataset"),
            # A judged run measured by `eval.reward_funcs`: how often each judge agreed with that measure.
            "heldout_judge_agreement_before": before and before.get("judge_agreement"),
            "heldout_judge_agreement_after": after and after.get("judge_agreement"),
            "affinity_share": router_affinity(router),
            **episode_summary(self.history, rollout, router),
            **distill_summary(self.history, rollout, self.teacher_heldout, self.teachers_heldout),
            "staleness_mean": self.stale_sum / self.stale_groups if self.stale_groups else None,
            "staleness_max": self.stale_max,
            "dropped_stale_share": rollout.dropped_stale_share,
            "partial_share": self.partial_samples / self.samples_trained if self.samples_trained else None,
            "cut_share": rollout.cut_share,
            "prefilled_again_total": rollout.prefilled_again_total,
            "dropped_failed_total": rollout.dropped_failed_total,
            "dropped_judge_failed_total": rollout.dropped_judge_failed_total,  # groups a judge with on_failure: drop lost
            **reward_error_summary(rollout),
            "ratio_mean": statistics.fmean(ratios) if ratios else None,
            "step_s_median": statistics.median([m["perf/step_s"] for m in self.history]) if self.history else None,
            "loop_wall_s": round(self.loop_s, 1),
            "trainer_idle_share": sum(m["perf/rollout_wait_s"] for m in self.history[self.own_from :]) / self.loop_s
            if self.loop_s
            else None,
            "generation_idle_share": (rollout.idle_s - self.idle_at_loop_start) / self.loop_s if self.loop_s else None,
            "wall_time_s": round(time.time() - self.t0, 1),
        }


class StepLog:
    """Where each step goes: the audit trail of trained groups, the metrics sink, the progress bar, the verdicts."""

    def __init__(self, stack: ExitStack, run: Run, initial_step: int):
        from app.metrics_sink import MetricsSink

        cfg = run.cfg
        self.cfg, self.run = cfg, run
        # Which groups each step trained: the audit trail of exactly-once across restarts (a resumed learner
        # repeats step numbers; the last line of a step is the one its checkpoints descend from).
        self.trained = stack.enter_context(open(cfg.run_dir / "trained_groups.jsonl", "a"))
        self.sink = MetricsSink(cfg.run_dir, cfg.logging.run_name, cfg.model_dump(mode="json"), cfg.logging.report_to)
        stack.callback(self.sink.close)
        self.bar = progress_bar(cfg, initial_step)
        stack.callback(self.bar.close)
        self.verdict: str | None = None  # the kind last printed

    def write(self, result: StepResult, metrics: dict) -> None:
        from app.diagnosis import diagnose

        self.trained.write(json.dumps({"step": result.step, "groups": result.trained_group_ids}) + "\n")
        self.trained.flush()
        self.sink.log(metrics, result.step)
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{metrics['reward']:.2f}",
            step_s=f"{metrics['perf/step_s']:.2f}",
            stale=f"{metrics['sample/staleness_mean']:.1f}",
            queue=int(metrics["sample/rollout_queue_size"]),
        )
        every = self.cfg.logging.diagnose_every
        if result.step % every == 0:  # judged every few steps, printed only when it changes (and at the end)
            verdict = diagnose(self.run.history[-every:], self.cfg)
            if verdict.kind not in (self.verdict, "warming-up"):
                self.verdict = verdict.kind
                self.bar.write(str(verdict))


def router_affinity(router: dict | None) -> float | None:
    """Share of routed requests that matched a specific prefix, from the fleet's /router/stats."""
    if not router:
        return None
    totals = router.get("totals", router)
    routed = totals.get("routed", 0)
    return totals.get("affinity", 0) / routed if routed else None


def reward_error_summary(rollout: RolloutStats) -> dict:
    """The samples each reward function failed on over the run (it raised, hung or returned the wrong count: those
    samples got None from it), so that a run whose rewards never worked says so in its summary, not only per step."""
    prefix = "reward/errors/"
    by_func = {k.removeprefix(prefix): int(v) for k, v in rollout.reward_metrics.items() if k.startswith(prefix)}
    return {"reward_errors_total": sum(by_func.values()), "reward_errors": by_func}


def episode_summary(history: list[dict], rollout: RolloutStats, router: dict | None) -> dict:
    """Multi-turn runs: turns per episode, truncated share, environment errors, and the router's affinity by turn
    (from turn 2 on, the share of requests that stayed on the replica holding their trajectory); {} otherwise."""
    steps = [m for m in history if "env/turns_mean" in m]
    if not steps:
        return {}
    return {
        "env_turns_mean": statistics.fmean(m["env/turns_mean"] for m in steps),
        "env_truncated_share": statistics.fmean(m["env/truncated_share"] for m in steps),
        "env_errors_total": rollout.env_errors_total,
        "affinity_by_turn": {k: v["affinity_share"] for k, v in (router or {}).get("turns", {}).items()},
    }


def distill_summary(
    history: list[dict], rollout: RolloutStats, teacher: dict | None, teachers: dict[str, dict] | None = None
) -> dict:
    """Distilling runs: the teacher's held-out accuracy, the reverse KL to it over the first and the last 10% of
    the steps, the groups its failures cost (with several teachers, each one's too, by name); {} otherwise."""
    kl = [m["distill/reverse_kl"] for m in history if "distill/reverse_kl" in m]
    if teacher is None and not kl and not teachers:
        return {}
    out = {
        "teacher_heldout_accuracy": teacher and teacher["accuracy"],
        "teacher_model": teacher and teacher["model"],
        "reverse_kl_start": window_mean(kl, 0.1, last=False),
        "reverse_kl_end": window_mean(kl, 0.1, last=True),
        "teacher_failed_total": rollout.teacher_failed_total,
    }
    if teachers:
        out["teachers"] = {
            name: {
                "heldout_accuracy": measured["accuracy"],
                "model": measured["model"],
                "reverse_kl_end": window_mean(
                    [m[k] for m in history if (k := f"distill/{name}/reverse_kl") in m and not math.isnan(m[k])],
                    0.1,
                    last=True,
                ),
                "failed_total": rollout.teacher_failed_by.get(name, 0),
            }
            for name, measured in teachers.items()
        }
    return out


def progress_bar(cfg: RunConfig, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.max_steps,
        initial=initial,
        desc=cfg.logging.run_name,
        unit="step",
        disable=not cfg.logging.progress_bar,
        dynamic_ncols=True,
    )


def previous_steps(run_dir: Path, resumed_step: int) -> list[dict]:
    """The metrics of steps 1..`resumed_step` as earlier processes of the run logged them (`metrics.jsonl`): a step
    logged twice (trained again after a crash lost it) counts as its last line, the one the checkpoint descends from."""
    path = run_dir / "metrics.jsonl"
    if resumed_step <= 0 or not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the process that died writing it
            continue
        if 0 < record.get("step", 0) <= resumed_step:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]
