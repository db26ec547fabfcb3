"""Asynchronous vs synchronous pipeline on the same config and number of steps, in one run.

The synchronous baseline generates a batch with the current policy, trains on it, syncs, and only
then generates again (`rollout.mode=sync`, `max_staleness=0`): each side idles while the other
works. The asynchronous pipeline (`max_staleness=4`) keeps generating while the learner trains.

    python -m bench.pipeline [--steps 40] [--set key=value ...]

Writes bench/results/pipeline.json: wall-time ratio, trainer and generation idle shares, reward reached.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import print_table, train_run, write_result

VARIANTS = {
    "async (max_staleness=4)": ["rollout.mode=async", "rollout.max_staleness=4"],
    "sync (max_staleness=0)": ["rollout.mode=sync", "rollout.max_staleness=0"],
}


def run_variant(name: str, sets: list[str], steps: int, extra: list[str], workdir: Path) -> dict:
    return train_run(
        "configs/tiny-cpu.yaml", [*sets, f"train.max_steps={steps}", *extra], workdir / name.split()[0], name
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-") as tmp:
        results = {
            name: run_variant(name, sets, args.steps, args.overrides, Path(tmp)) for name, sets in VARIANTS.items()
        }
    a, s = results.values()
    keys = [
        "loop_wall_s",
        "step_s_median",
        "trainer_idle_share",
        "generation_idle_share",
        "reward_last_10pct",
        "heldout_accuracy_before",
        "heldout_accuracy_after",
        "staleness_mean",
        "dropped_stale_share",
    ]
    rows = [[k, *(f"{r[k]:.3f}" if isinstance(r.get(k), float) else r.get(k) for r in results.values())] for k in keys]
    ratio = s["loop_wall_s"] / a["loop_wall_s"]
    print_table(["metric", *results], rows, title=f"pipeline: {args.steps} steps, same config")
    print(f"\nsync / async wall time of the training loop: {ratio:.2f}x")
    path = write_result(
        "pipeline",
        {
            "steps": args.steps,
            "overrides": args.overrides,
            "variants": results,
            "ratios": {"sync_over_async_loop_wall": ratio},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
