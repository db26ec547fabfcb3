"""A judge's reward against the exact answer's, side by side in one run: the same student, problems and samples.

The workload is the shipped judge demo (`configs/tiny-judge.yaml`): the tiny model, also taught to judge an answer
against the gold one (`model.tiny.warmup_judge`, `tiny.judge`), serves as its own judge on the fleet (a logprob
verdict, one scoring pass per group), and the student learns from that judge alone. The baseline is the same config
rewarded by `exact_answer`, as the embedded default is. Both arms are measured by the exact answer on the same 256
held-out problems (`eval.reward_funcs`), before and after, and are whole `launch.train` runs of the same steps on a
fleet of their own; the judge arm also reports how often its judge agreed with the exact answer on the held-out
samples, before and after (`heldout_judge_agreement_*`), and what the judge cost the loop (its seconds per group).

    python -m bench.judge [--steps 150] [--set key=value ...]

Writes bench/results/judge.json: per arm held-out before, after and gain, loop time; the judge arm's agreement and
judge metrics; the gain and loop-time ratios of judge to exact.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import print_table, read_metrics, train_run, write_result

CONFIG = "configs/tiny-judge.yaml"
ARMS = {"judge": [], "exact": ["task.reward_funcs=[exact_answer]"]}
ROWS = [
    "heldout_accuracy_before",
    "heldout_accuracy_after",
    "heldout_gain",
    "judge_agreement_before",
    "judge_agreement_after",
    "judge_seconds_per_group",
    "judge_failed_total",
    "loop_wall_s",
]


def judge_figures(summary: dict, steps: list[dict]) -> dict:
    """The judge arm's agreement with the exact answer, and its cost: seconds per request (one per group) and the
    samples it failed to score, from the last step's cumulative metrics."""
    last = steps[-1] if steps else {}
    requests = sum(v for k, v in last.items() if k.startswith("judge/") and k.endswith("/requests"))
    seconds = sum(v for k, v in last.items() if k.startswith("judge/") and k.endswith("/seconds"))
    agreement = {
        when: next(iter((summary.get(f"heldout_judge_agreement_{when}") or {}).values()), None)
        for when in ("before", "after")
    }
    return {
        "judge_agreement_before": agreement["before"],
        "judge_agreement_after": agreement["after"],
        "judge_seconds_per_group": seconds / requests if requests else None,
        "judge_failed_total": last.get("judge/failed_total"),
    }


def run_arm(name: str, sets: list[str], steps: int, overrides: list[str], workdir: Path) -> dict:
    out = workdir / name
    summary = train_run(CONFIG, [*sets, f"train.max_steps={steps}", *overrides], out, name)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    figures = judge_figures(summary, read_metrics(out / "bench")) if name == "judge" else {}
    return {**summary, "heldout_gain": after - before, **figures}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps of each arm (the demo's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="key=value for every arm")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        arms = {name: run_arm(name, sets, args.steps, args.overrides, Path(tmp)) for name, sets in ARMS.items()}
    print_table(["", *arms], [[row, *(fmt(a.get(row)) for a in arms.values())] for row in ROWS], title="judge")
    judge, exact = arms["judge"], arms["exact"]
    ratios = {
        "gain_points_judge_minus_exact": 100 * (judge["heldout_gain"] - exact["heldout_gain"]),
        "loop_wall_judge_over_exact": judge["loop_wall_s"] / exact["loop_wall_s"],
    }
    print(
        f"judge: held-out gain {100 * judge['heldout_gain']:+.1f} points against exact's "
        f"{100 * exact['heldout_gain']:+.1f} ({ratios['gain_points_judge_minus_exact']:+.1f}); loop "
        f"{ratios['loop_wall_judge_over_exact']:.2f}x; agreement with the exact answer "
        f"{fmt(judge['judge_agreement_before'])} -> {fmt(judge['judge_agreement_after'])}"
    )
    path = write_result("judge", {"steps": args.steps, "config": CONFIG, "arms": arms, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
