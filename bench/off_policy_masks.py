"""GRPO's off-policy guards at high staleness, side by side in one run: truncated importance sampling (TIS) alone
against TIS with the sequence mask and the token mask, and against sequence truncation in TIS's place with the token
mask (issue 47 item 2).

The workload is the embedded default (`configs/tiny-cpu.yaml`) with four times the groups in flight and
`rollout.max_staleness` 8, so that groups are trained several versions after the one that sampled them: the regime
where verl's and SkyRL's masks are said to keep learning stable where TIS alone does not. Each arm is a whole
`launch.train` run of the same steps on a fleet of its own (held-out before and after, greedy, 256 problems: one
accuracy moves by about 3 points, and one seed per arm by a few more).

    python -m bench.off_policy_masks [--steps 40] [--set key=value ...]

Writes bench/results/off_policy_masks.json: held-out gain, staleness, the ratio's spread (`ratio/std`), the share
of tokens the guards dropped and the samples masked or capped a step (medians and maxima over the steps), loop time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import print_table, read_metrics, train_run, write_result

CONFIG = "configs/tiny-cpu.yaml"
GRPO = "kind: grpo, epsilon: 0.2, epsilon_high: 0.2"  # the embedded default's objective, with each arm's guards
ARMS = {
    "tis": f"objectives=[{{{GRPO}, vllm_importance_sampling_correction: true}}]",
    "tis + masks": f"objectives=[{{{GRPO}, vllm_importance_sampling_correction: true, sequence_is: mask, "
    "token_mask: true}]",
    "truncation + token mask": f"objectives=[{{{GRPO}, vllm_importance_sampling_correction: false, "
    "sequence_is: truncate, token_mask: true}]",
}
# Work far ahead of the learner: up to 8 versions stale (the bucket keeps them all), no evaluation during the run.
WORKLOAD = [
    "rollout.max_staleness=8",
    "bucket.keep_versions=20",
    "rollout.queue_maxsize=64",
    "rollout.max_inflight_tasks=32",
    "eval.every_steps=0",
]
FIGURES = {  # metrics.jsonl key -> name in the result, each as median and max over the steps
    "ratio/std": "ratio_std",
    "off_policy/masked_share": "masked_share",
    "off_policy/masked_sequences": "masked_sequences",
    "off_policy/truncated_sequences": "truncated_sequences",
}


def step_figures(steps: list[dict]) -> dict[str, float]:
    """Median and max over the logged steps of what the guards did and what the drift alarm reads; a figure no step
    logged (a guard that is off) is left out."""
    out = {}
    for key, name in FIGURES.items():
        values = [m[key] for m in steps if key in m]
        if values:
            out[f"{name}_median"], out[f"{name}_max"] = statistics.median(values), max(values)
    return out


def run_arm(name: str, objective: str, steps: int, overrides: list[str], workdir: Path) -> dict:
    out = workdir / name.replace(" ", "")
    summary = train_run(CONFIG, [*WORKLOAD, objective, f"train.max_steps={steps}", *overrides], out, name)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    return {**summary, "heldout_gain": after - before, **step_figures(read_metrics(out / "bench"))}


ROWS = [
    "heldout_accuracy_before",
    "heldout_accuracy_after",
    "heldout_gain",
    "staleness_mean",
    "staleness_max",
    "ratio_std_median",
    "ratio_std_max",
    "masked_share_median",
    "masked_share_max",
    "masked_sequences_median",
    "truncated_sequences_median",
    "loop_wall_s",
]


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps of each arm")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="key=value for every arm")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-off-policy-masks-") as tmp:
        arms = {name: run_arm(name, obj, args.steps, args.overrides, Path(tmp)) for name, obj in ARMS.items()}
    print_table(
        ["", *arms], [[row, *(fmt(a.get(row)) for a in arms.values())] for row in ROWS], title="off-policy guards"
    )
    base = arms["tis"]["heldout_gain"]
    for name, arm in arms.items():
        if name != "tis":
            print(f"{name}: held-out gain {100 * (arm['heldout_gain'] - base):+.1f} points against TIS alone")
    path = write_result("off_policy_masks", {"steps": args.steps, "workload": WORKLOAD, "arms": arms})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
