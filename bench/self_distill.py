"""Self-distillation, spotrl vs TRL's SDFTTrainer, and GRPO alone: the same student, data and samples, in one run.

spotrl's self teacher (`teacher: {self: {model: base, context: ...}}`) is TRL 1.16's `SDFTTrainer` as one more
teacher kind of the asynchronous pipeline (docs/distillation.md), so TRL's trainer is the baseline that tells
whether the fleet and the asynchrony cost learning per sample, and what they save in wall time; GRPO alone on the
same student tells what the privileged teacher adds over the reward. The three arms:

- `spotrl`: `configs/tiny-self-distill.yaml` as shipped (its base model shown the answer scores the student's
  samples, reverse KL on the sampled tokens), `launch.train` on a fleet of its own;
- `trl`: TRL's `SDFTTrainer`, used unchanged, with the same choices: `teacher_model_kind="base"` (the adapter
  disabled), `distillation_mode="sampled_token"` with `distillation_alpha=1.0` (the reverse KL at the sampled token,
  the only alpha that mode takes), the teacher prompt spotrl renders (`teacher_prompt_template` is the config's
  `context` with `{answer}` as TRL's `{privileged_context}`, a column holding each problem's answer), generation on
  the CPU with transformers (`use_vllm=False`); the same tiny model folder (`tiny.build.prepare_model`), LoRA
  (rank 8, alpha 16, all linear layers, zero-initialised B), train split, learning rate, AdamW, gradient clipping,
  constant schedule, temperature, G and 16 prompts x G samples per optimizer step; in a child process of its own
  while no fleet or Ray runs, so it has the machine to itself;
- `grpo`: the same config with `objectives: [grpo]` (its `exact_answer` reward), on a fleet of its own.

What the two self-distillation arms still do differently is what each trainer is: spotrl samples with vLLM on its
replicas and scores through the fleet's `prompt_logprobs` (the shipped config on-policy: each step's groups sampled
under the version the learner trains, `rollout.mode: sync`) and divides the step's token sum by its tokens; TRL
generates, scores with the teacher and trains in turn in one process, and averages per sequence first. The adapters at every `--every` steps (TRL's saved by a
callback, its saving time left out of its wall time) are evaluated afterwards the same way for all three arms:
greedy held-out accuracy through the fleet (`bench.vs_trl.evaluate_folder`, `app.evaluate`). Wall time at step S is
time in the training loop (spotrl: the driver's loop; TRL: from `on_train_begin`). Nothing is downloaded; Ray and the
fleet listen on 127.0.0.1 only.

    python -m bench.self_distill [--steps 30] [--every 6]

30 steps by default, the shipped config's, for all three arms alike: on the quiet 2-core box TRL's trainer took about
0.24 s a step (transformers' generate, then the student's and the teacher's forward in turn), spotrl's 1.6 s. The run
also prints, from the fleet arms' metrics, where their step went (`step_phases`): waiting for the step's groups,
training, the teacher's seconds per group.

Writes bench/results/self_distill.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bench_run_sets, print_table, read_metrics, write_result
from bench.vs_trl import checkpoint_rows, evaluate_folder, run_spotrl, samples_per_step
from tests.support.fleet_helpers import free_port

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny-self-distill.yaml"
ARMS = ("spotrl", "trl", "grpo")


def trl_template(context: str) -> str:
    """TRL's `teacher_prompt_template` for spotrl's self-teacher `context`: the answer becomes TRL's one privileged
    field; a context naming any other privileged field has no single-column equivalent and is refused."""
    from core.config.context import template_fields

    fields = set(template_fields(context))
    if fields != {"prompt", "answer"}:
        raise SystemExit(f"bench.self_distill compares a context of {{prompt}} and {{answer}} only, not {context!r}")
    return context.replace("{answer}", "{privileged_context}")


def self_teacher(cfg):
    """The shipped config's self teacher (its `context` and `model`)."""
    distill = next(o for o in cfg.objectives if o.kind == "distill")
    return distill.teacher.self_teacher


def arm_config(arm: str, workdir: Path, steps: int, port: int, extra: list[str] | None = None):
    """The shipped config, as run `bench` under `workdir/arm`: `grpo` with GRPO as its only objective; every step's
    adapter kept, the fleet trusting the bucket's and TRL's adapter folders."""
    from core.config import load_config

    out = workdir / arm
    adapters = out / "bench" / "bucket" / "adapters"
    adapters.mkdir(parents=True, exist_ok=True)
    trusted = [str(adapters), str(workdir / "trl" / "adapters")]
    sets = [
        *bench_run_sets(out, workdir, steps, port, trusted),
        *(extra or []),
    ]
    if arm == "grpo":
        sets.append(f"objectives={json.dumps([{'kind': 'grpo'}])}")
    return load_config(CONFIG, sets)


# ---- TRL's SDFTTrainer (a child process: TRL's and accelerate's state never touch spotrl's) ---------------------


def trl_args(cfg, out: Path, steps: int):
    """SDFTConfig with the shipped config's choices (module docstring): the same samples per optimizer step, one
    generation batch a step, fp32 on the CPU, transformers' generate."""
    from trl.experimental.sdft import SDFTConfig

    t, s = cfg.train, cfg.sampling
    return SDFTConfig(
        output_dir=str(out),
        teacher_model_kind=self_teacher(cfg).model,
        teacher_prompt_template=trl_template(self_teacher(cfg).context),
        distillation_mode="sampled_token",
        distillation_alpha=1.0,  # reverse KL(student || teacher): what spotrl's sampled mode estimates
        use_vllm=False,
        learning_rate=t.learning_rate,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        num_generations=s.num_generations,
        max_completion_length=s.max_completion_length,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),  # spotrl's -1 and TRL's 0 both mean no top-k
        max_steps=steps,
        seed=t.seed,
        per_device_train_batch_size=samples_per_step(cfg),  # 16 prompts x G, one optimizer step
        gradient_accumulation_steps=1,
        bf16=False,  # fp32 on the CPU, like spotrl's learner
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
    )


def trl_main(args) -> None:
    """Train with TRL's SDFTTrainer; save the adapter at each step of `args.save_at`, write the wall times."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.sdft import SDFTTrainer

    from app.kinds.registry import problems_of
    from app.learner.model import peft_lora_config
    from core.config import load_config
    from core.models import load_tokenizer

    cfg = load_config(CONFIG, args.overrides)
    out = Path(args.out)
    tokenizer = load_tokenizer(args.model_path)
    train = problems_of(cfg).train
    probe = train[0].prompt
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise SystemExit("the tokenizer adds special tokens to a prompt: TRL's prompts would differ from spotrl's")
    dataset = Dataset.from_dict(
        {"prompt": [p.prompt for p in train], "privileged_context": [str(p.answer) for p in train]}
    )
    lora = peft_lora_config(cfg.lora)
    wall: dict[int, float] = {}
    losses: list[float] = []

    class SaveAt(TrainerCallback):
        """Saves the adapter at the measured steps; the saving time is left out of the wall time."""

        def on_train_begin(self, *_a, **_k):
            self.t0, self.paused = time.time(), 0.0

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs and "self_distillation/distillation_loss" in logs:
                losses.append(logs["self_distillation/distillation_loss"])

        def on_step_end(self, _args, state, _control, model=None, **_k):
            if state.global_step in args.save_at:
                wall[state.global_step] = time.time() - self.t0 - self.paused
                t = time.time()
                model.save_pretrained(out / "adapters" / f"trl-step-{state.global_step}")
                self.paused += time.time() - t

    torch.manual_seed(cfg.train.seed)
    trainer = SDFTTrainer(
        model=args.model_path,
        args=trl_args(cfg, out, max(args.save_at)),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[SaveAt()],
    )
    trainer.train()
    (out / "wall.json").write_text(json.dumps({"wall": wall, "distillation_loss": losses}))


def run_trl(overrides: list[str], model_path: str, steps: list[int], workdir: Path) -> dict:
    """TRL's trainer in a child process; its wall times and the folders of its adapters."""
    out = workdir / "trl"
    cmd = [sys.executable, "-m", "bench.self_distill", "--trl-worker", "--model-path", model_path, "--out", str(out)]
    cmd += ["--save-at", *map(str, steps), *(a for s in overrides for a in ("--set", s))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log_path = workdir / "trl.log"
    print(f"running TRL's SDFTTrainer (log: {log_path})", flush=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed:\n{log_path.read_text()[-4000:]}")
    result = json.loads((out / "wall.json").read_text())
    wall = {int(k): v for k, v in result["wall"].items()}
    print(f"TRL: {total:.0f} s in all, loop {wall[max(wall)]:.0f} s", flush=True)
    return {"wall": wall, "process_s": round(total, 1), "distillation_loss": result["distillation_loss"]}


# ---- the run ----------------------------------------------------------------------------------------------------


def run_fleet_arm(
    cfg, model_path: str, steps: list[int], context: str, trl: dict | None = None, trl_adapters: Path | None = None
) -> dict:
    """One fleet of the config's: its base evaluated, and shown the answer under `context` (the teacher), TRL's
    adapters in `trl_adapters` evaluated where `trl` is given, then the spotrl run of the config on it and its adapters
    evaluated."""
    from app.evaluate import base_model_name, evaluate
    from app.fleet_client import FleetClient
    from deployments.fleet import deploy_fleet, shutdown_fleet

    result: dict = {}
    try:
        url = deploy_fleet(cfg.own_fleet(), model_path)
        base_name = base_model_name(FleetClient(url))
        result["base_accuracy"] = evaluate(cfg, url, model_path, base_name)["accuracy"]
        result["teacher_accuracy"] = evaluate(cfg, url, model_path, base_name, context=context)["accuracy"]
        print(f"base held-out {result['base_accuracy']:.3f}, shown the answer {result['teacher_accuracy']:.3f}")
        if trl is not None:
            points = {}
            for step in steps:
                folder = trl_adapters / f"trl-step-{step}"
                acc = evaluate_folder(cfg, url, model_path, f"trl-step-{step}", folder)
                points[step] = {
                    "accuracy": acc,
                    "wall_s": round(trl["wall"][step], 1),
                    "samples": step * samples_per_step(cfg),
                }
                print(f"TRL step {step}: held-out {acc:.3f}, loop {trl['wall'][step]:.1f} s", flush=True)
            result["trl_points"] = points
        t0 = time.time()
        result["points"] = run_spotrl(cfg, url, model_path, steps, Path(cfg.logging.output_dir).name)  # the arm
        result["train_s"] = round(time.time() - t0, 1)
    finally:
        shutdown_fleet(cfg, stop_serve=False)
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    for key in ("loop_wall_s", "step_s_median", "reverse_kl_start", "reverse_kl_end", "teacher_failed_total"):
        result[key] = summary.get(key)
    result["phases"] = step_phases(cfg.run_dir)
    return result


def step_phases(run_dir: Path) -> dict:
    """Where a spotrl step's wall time went, medians over its steps: the learner waiting for the step's groups
    (generation and, for self-distillation, the teacher's scoring), its training step (forward, backward,
    optimizer, weight sync), and the teacher's seconds per group (each group's request, summed over a step's groups
    and divided by them: they run at once, so this is not wall time)."""
    metrics = read_metrics(run_dir)

    def median(key: str, per_group: bool = False) -> float | None:
        values = [m[key] / (m["batch/groups"] if per_group else 1) for m in metrics if key in m]
        return round(statistics.median(values), 3) if values else None

    return {
        "rollout_wait_s": median("perf/rollout_wait_s"),
        "learner_step_s": median("perf/step_s"),
        "weight_sync_s": median("perf/weight_sync_s"),
        "teacher_s_per_group": median("distill/teacher_s", per_group=True),
    }


def arm_rows(points: dict[int, dict], base: float) -> list[dict]:
    return checkpoint_rows(points, base)


def ratios(arms: dict[str, dict]) -> dict:
    """Per measured step: spotrl's accuracy minus TRL's and minus GRPO's, TRL's loop wall over spotrl's; medians."""
    per_step = []
    for s, t, g in zip(arms["spotrl"]["points"], arms["trl"]["points"], arms["grpo"]["points"], strict=True):
        per_step.append(
            {
                "step": s["step"],
                "samples": s["samples"],
                "spotrl_minus_trl": round(s["accuracy"] - t["accuracy"], 4),
                "spotrl_minus_grpo": round(s["accuracy"] - g["accuracy"], 4),
                "trl_wall_over_spotrl": round(t["wall_s"] / s["wall_s"], 2) if s["wall_s"] > 0 else None,
                "spotrl_wall_over_trl": round(s["wall_s"] / t["wall_s"], 2) if t["wall_s"] > 0 else None,
            }
        )
    return {
        "per_step": per_step,
        "median_spotrl_minus_trl": statistics.median(p["spotrl_minus_trl"] for p in per_step),
        "median_spotrl_minus_grpo": statistics.median(p["spotrl_minus_grpo"] for p in per_step),
        "median_trl_wall_over_spotrl": statistics.median(
            p["trl_wall_over_spotrl"] for p in per_step if p["trl_wall_over_spotrl"] is not None
        ),
    }


def table_rows(arms: dict[str, dict]) -> list[list[str]]:
    rows = []
    for i, s in enumerate(arms["spotrl"]["points"]):
        cells = [f"step {s['step']} ({s['samples']} samples)"]
        for arm in ARMS:
            p = arms[arm]["points"][i]
            cells.append(f"{p['accuracy']:.3f} @ {p['wall_s']:.0f} s")
        rows.append(cells)
    kl = arms["spotrl"]
    rows.append(["reverse KL start -> end", f"{kl['reverse_kl_start']:.3f} -> {kl['reverse_kl_end']:.3f}", "-", "-"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-at", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.trl_worker:
        trl_main(args)
        return
    import ray

    from core.local_ray import start_ray
    from tiny.build import prepare_model

    steps = list(range(args.every, args.steps + 1, args.every))
    workdir = Path(tempfile.mkdtemp(prefix="spotrl-bench-self-distill-"))
    (workdir / "trl" / "adapters").mkdir(parents=True)
    load_start = os.getloadavg()[0]
    t_start = time.time()
    try:
        port = free_port()  # Serve's proxy keeps the port it started on: both fleets get the same one
        spotrl_cfg = arm_config("spotrl", workdir, args.steps, port)
        model_path = prepare_model(spotrl_cfg.model, spotrl_cfg.task)
        # TRL first, on a machine where no Ray and no fleet run yet; its adapters are evaluated on spotrl's fleet.
        trl = run_trl([], model_path, steps, workdir)
        start_ray(None, offline=True)
        try:
            context = self_teacher(spotrl_cfg).context
            spotrl = run_fleet_arm(spotrl_cfg, model_path, steps, context, trl, workdir / "trl" / "adapters")
            grpo = run_fleet_arm(arm_config("grpo", workdir, args.steps, port), model_path, steps, context)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = spotrl["base_accuracy"]
    arms = {
        "spotrl": {
            "points": arm_rows(spotrl["points"], base),
            "loop_wall_s": spotrl["loop_wall_s"],
            "train_s": spotrl["train_s"],
            "step_s_median": spotrl["step_s_median"],
            "reverse_kl_start": spotrl["reverse_kl_start"],
            "reverse_kl_end": spotrl["reverse_kl_end"],
            "teacher_failed_total": spotrl["teacher_failed_total"],
            "phases": spotrl["phases"],
        },
        "trl": {
            "points": arm_rows(spotrl["trl_points"], base),
            "loop_wall_s": trl["wall"][max(trl["wall"])],
            "process_s": trl["process_s"],
            "distillation_loss_start_end": trl["distillation_loss"][:1] + trl["distillation_loss"][-1:],
        },
        "grpo": {
            "points": arm_rows(grpo["points"], base),
            "loop_wall_s": grpo["loop_wall_s"],
            "train_s": grpo["train_s"],
            "step_s_median": grpo["step_s_median"],
            "phases": grpo["phases"],
        },
    }
    summary = ratios(arms)
    title = (
        f"self-distillation: spotrl vs TRL SDFTTrainer vs GRPO alone, same student (held-out {base:.3f}, "
        f"shown the answer {spotrl['teacher_accuracy']:.3f}), {samples_per_step(spotrl_cfg)} samples a step"
    )
    print_table(["held-out @ loop wall", *ARMS], table_rows(arms), title=title)
    print(
        f"\nmedian over the measured steps: spotrl - TRL {summary['median_spotrl_minus_trl']:+.3f}, "
        f"spotrl - GRPO {summary['median_spotrl_minus_grpo']:+.3f}, "
        f"TRL wall / spotrl wall {summary['median_trl_wall_over_spotrl']:.2f}x"
    )
    for arm in ("spotrl", "grpo"):
        phases = arms[arm]["phases"]
        print(
            f"{arm} step, medians: waiting for its groups {phases['rollout_wait_s']:.2f} s, training "
            f"{phases['learner_step_s']:.2f} s (weight sync {phases['weight_sync_s']:.2f} s)"
            + (f", teacher {phases['teacher_s_per_group']:.2f} s per group" if phases["teacher_s_per_group"] else "")
        )
    trl_step = arms["trl"]["loop_wall_s"] / args.steps
    print(f"TRL's whole step (generate, teacher, train), mean: {trl_step:.2f} s")
    path = write_result(
        "self_distill",
        {
            "steps": steps,
            "samples_per_step": samples_per_step(spotrl_cfg),
            "base_accuracy": base,
            "teacher_accuracy": spotrl["teacher_accuracy"],
            "arms": arms,
            "summary": summary,
            "bench_wall_s": round(time.time() - t_start, 1),
            "loadavg_1m_at_start": round(load_start, 2),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
