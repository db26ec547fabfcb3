"""Partial rollouts and the two staleness rules on a slow-environment multi-turn workload, side by side in one run.

The workload is `configs/tiny-multiturn.yaml` (chained-arithmetic episodes of 2-3 turns) with an environment
that takes `--latency` seconds to answer each turn, as a slow tool or sandbox does, and more groups in flight
than the learner consumes per version, so that an episode spans several policy versions. Four arms, each a
full `launch.train` run of the same steps from the same warmed-up model:

- `drop_at_take`: today's rule; an episode's later turns under the version it started with;
- `partial`: partial rollouts on (cut generations continued and later turns sampled under the newest version);
- `bound_at_admission`: the admission bound, finished work trained under the hard limit;
- `partial + bound_at_admission`: both.

    python -m bench.partial_rollouts [--steps 30] [--latency 0.3] [--set key=value ...]

Writes bench/results/partial_rollouts.json: loop time for the same steps, trainer idle share, dropped-stale share,
tokens prefilled again, held-out gain, staleness, the share of samples spanning several versions, and the healthy
spread of the drift alarm's figures (clip share, ratio/std) that its thresholds sit above.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import print_table, read_metrics, train_run, write_result

CONFIG = "configs/tiny-multiturn.yaml"
ARMS = {
    "drop_at_take": ["rollout.partial_rollouts=false", "rollout.staleness_rule=drop_at_take"],
    "partial": ["rollout.partial_rollouts=true", "rollout.staleness_rule=drop_at_take"],
    "bound_at_admission": ["rollout.partial_rollouts=false", "rollout.staleness_rule=bound_at_admission"],
    "partial + bound_at_admission": ["rollout.partial_rollouts=true", "rollout.staleness_rule=bound_at_admission"],
}
# Twice the config's groups in flight: more work ahead of the learner than `max_staleness` versions consume.
WORKLOAD = ["rollout.max_inflight_tasks=32", "rollout.queue_maxsize=32", "env.timeout_s=10"]


def alarm_figures(run_dir: Path) -> dict:
    """Median and max over the steps of the run in `run_dir` of what the drift alarm reads (`app.diagnosis`)."""
    steps = read_metrics(run_dir)
    out = {}
    for key, name in (("clip_ratio/region_mean", "clip_share"), ("ratio/std", "ratio_std")):
        values = [m[key] for m in steps if key in m]
        if values:
            out[f"{name}_median"], out[f"{name}_max"] = statistics.median(values), max(values)
    return out


def run_arm(name: str, sets: list[str], args, workdir: Path) -> dict:
    out = workdir / name.replace(" + ", "+")
    sets = [*WORKLOAD, f"env.kwargs={{latency_s: {args.latency}}}", *sets, f"train.max_steps={args.steps}"]
    summary = train_run(CONFIG, [*sets, *args.overrides], out, name)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    return {
        **summary,
        "heldout_gain": after - before if before is not None and after is not None else None,
        **alarm_figures(out / "bench"),
    }


ROWS = [
    "loop_wall_s",
    "step_s_median",
    "trainer_idle_share",
    "dropped_stale_share",
    "prefilled_again_total",
    "cut_share",
    "partial_share",
    "heldout_accuracy_before",
    "heldout_accuracy_after",
    "heldout_gain",
    "staleness_mean",
    "staleness_max",
    "ratio_mean",
    "clip_share_median",
    "clip_share_max",
    "ratio_std_median",
    "ratio_std_max",
    "bottleneck",
]


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--latency", type=float, default=0.3, help="seconds the environment takes per turn")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-") as tmp:
        results = {name: run_arm(name, sets, args, Path(tmp)) for name, sets in ARMS.items()}
    base = results["drop_at_take"]
    print_table(
        ["metric", *results],
        [[k, *(cell(r.get(k)) for r in results.values())] for k in ROWS],
        title=f"partial rollouts: {args.steps} steps, environment latency {args.latency} s per turn",
    )
    ratios = {f"{name} / drop_at_take loop wall": r["loop_wall_s"] / base["loop_wall_s"] for name, r in results.items()}
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    elapsed = time.time() - started
    print(f"bench wall time: {elapsed / 60:.1f} min")
    path = write_result(
        "partial_rollouts",
        {
            "steps": args.steps,
            "latency_s": args.latency,
            "workload": WORKLOAD,
            "overrides": args.overrides,
            "arms": results,
            "ratios": ratios,
            "bench_wall_s": round(elapsed),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
