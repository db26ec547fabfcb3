"""GRPO alone, on-policy distillation alone, and both, from the same student at equal samples, in one run.

The three variants train the same tiny student (`configs/tiny-distill.yaml`: the untrained tiny default, 16
prompts x 8 samples a step, the same seed, learning rate and LoRA) for `--steps` steps, each on a fleet of its
own deployed here on one loopback Ray (one student replica and the teacher deployment, the same for every
variant, so they share the machine alike) with a fresh bucket. The adapters at every `--every` steps are
evaluated afterwards the same way (greedy held-out accuracy through the fleet, `bench.vs_trl`'s evaluation).
Reported side by side: held-out accuracy at equal steps, the steps each variant needs to reach GRPO's final
accuracy, loop wall time, the reverse KL to the teacher at the start and the end, the teacher's accuracy.

    python -m bench.distill [--steps 60] [--every 10]

Writes bench/results/distill.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

from bench.common import bench_run_sets, print_table, write_result
from bench.vs_trl import checkpoint_rows, run_spotrl, samples_per_step
from tests.support.fleet_helpers import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny-distill.yaml"


def variants(distill: dict) -> dict[str, list[dict]]:
    """The objectives of each variant; `distill` is the shipped config's distill objective (its teacher)."""
    return {"grpo": [{"kind": "grpo"}], "distill": [distill], "grpo+distill": [{"kind": "grpo"}, distill]}


def variant_config(name: str, objectives: list[dict], workdir: Path, steps: int, port: int):
    from core.config import load_config

    out = workdir / name
    (out / "bench" / "bucket" / "adapters").mkdir(parents=True)
    return load_config(
        CONFIG,
        [
            f"objectives={json.dumps(objectives)}",
            *bench_run_sets(out, workdir, steps, port, [str(out / "bench" / "bucket" / "adapters")]),
        ],
    )


def run_variant(cfg, teacher, steps: list[int]) -> dict:
    """A fleet of its own (with the teacher deployment whatever the variant), the run, its adapters evaluated."""
    from app.evaluate import base_model_name, evaluate
    from app.fleet_client import FleetClient
    from deployments.fleet import deploy_fleet, shutdown_fleet
    from tiny.build import prepare_model

    model_path = prepare_model(cfg.model, cfg.task)
    try:
        url = deploy_fleet(cfg.own_fleet().model_copy(update={"teacher": teacher}), model_path)
        base = evaluate(cfg, url, model_path, base_model_name(FleetClient(url)))["accuracy"]
        points = run_spotrl(cfg, url, model_path, steps)
    finally:
        shutdown_fleet(cfg, stop_serve=False)
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    kept = ("loop_wall_s", "step_s_median", "teacher_heldout_accuracy", "reverse_kl_start", "reverse_kl_end")
    return {"base_accuracy": base, "points": checkpoint_rows(points, base), **{k: summary.get(k) for k in kept}}


def steps_to_reach(points: list[dict], accuracy: float) -> int | None:
    """The first measured step at which a variant's held-out accuracy reached `accuracy` (None: never)."""
    return next((p["step"] for p in points if p["accuracy"] >= accuracy), None)


def table_rows(results: dict[str, dict], steps: list[int], target: float) -> list[list[str]]:
    def fmt(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    first = next(iter(results.values()))["points"]
    rows = [
        [f"held-out at step {s} ({p['samples']} samples)", *(fmt(r["points"][i]["accuracy"]) for r in results.values())]
        for i, (s, p) in enumerate(zip(steps, first, strict=True))
    ]
    rows.append(
        [
            f"steps to GRPO's final {target:.3f}",
            *(fmt(steps_to_reach(r["points"], target), "d") for r in results.values()),
        ]
    )
    rows.append(["loop wall s", *(fmt(r["loop_wall_s"], ".0f") for r in results.values())])
    rows.append(["median step s", *(fmt(r["step_s_median"], ".2f") for r in results.values())])
    rows.append(
        [
            "reverse KL start -> end",
            *(f"{fmt(r['reverse_kl_start'])} -> {fmt(r['reverse_kl_end'])}" for r in results.values()),
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import ray

    from core.config import load_config
    from core.local_ray import start_ray
    from tiny.build import name_built

    shipped = load_config(CONFIG)
    distill = next(o for o in shipped.objectives if o.kind == "distill").model_dump(mode="json")
    teacher = shipped.own_fleet().teacher
    name_built(teacher.model, shipped.task)  # the tiny teacher, which its deployment loads by its folder
    steps = list(range(args.every, args.steps + 1, args.every))
    workdir = Path(tempfile.mkdtemp(prefix="spotrl-bench-distill-"))
    start_ray(None, offline=True)
    try:
        port = free_port()  # Serve's proxy keeps the port it started on: every variant's fleet gets the same one
        results = {
            name: run_variant(variant_config(name, objectives, workdir, args.steps, port), teacher, steps)
            for name, objectives in variants(distill).items()
        }
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    target = results["grpo"]["points"][-1]["accuracy"]
    teacher_accuracy = results["grpo+distill"]["teacher_heldout_accuracy"]
    per_step = samples_per_step(shipped)
    title = f"GRPO vs distillation vs both, same student, {per_step} samples a step (teacher held-out {teacher_accuracy:.3f})"
    print_table(["", *results], table_rows(results, steps, target), title=title)
    reached = {name: steps_to_reach(r["points"], target) for name, r in results.items()}
    path = write_result(
        "distill",
        {
            "steps": steps,
            "samples_per_step": per_step,
            "teacher_heldout_accuracy": teacher_accuracy,
            "grpo_final_accuracy": target,
            "steps_to_grpo_final": reached,
            "variants": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
