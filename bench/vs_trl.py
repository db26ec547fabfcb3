"""spotrl vs TRL's AsyncGRPOTrainer on the same fleet, model, task, splits and hyper-parameters, in one run.

TRL's trainer is the reference implementation our GRPO loss follows, so it is the baseline that tells
whether our speed costs learning. Both trainers sample from ONE fleet (deployed here, on a loopback Ray),
start from the same tiny model with a zero-initialised LoRA (r8, alpha 16, all linear layers), train on
the same train split with the same reward, lr, AdamW defaults, clipping, G, prompts per step and
staleness, and consume the same 128 samples per optimizer step (TRL: `token_budget=0` and
`per_device_train_batch_size=128`; its default `token_budget` would make a step one 64-token row,
i.e. about 8 samples). The adapters at the measured step counts are saved, then both are evaluated
the same way afterwards: greedy held-out accuracy through the fleet (`app.evaluate`), loaded from
trusted folders (`fleet.extra_adapter_dirs`). Wall time at step S is time in the training loop.

    python -m bench.vs_trl [--steps 10 20 30]

TRL runs as released except for the CPU-only obstacles, patched in `patch_trl_for_cpu` (each with
its reason). Nothing is downloaded. Writes bench/results/vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import print_table, read_metrics, write_result
from tests.support.fleet_helpers import free_port

REPO = Path(__file__).resolve().parent.parent
# A chat template that renders the raw prompt: TRL's rollout worker always goes through one, and the
# tiny model has none; the prompt tokens are then exactly the ones spotrl sends.
RAW_PROMPT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# TRL parses every completion into a message with the tokenizer's response template (transformers'
# parser reads the prompt and the completion, and keeps what follows the last start anchor). Our
# prompts end with "Answer: " and completions are plain text; the reward scores the token ids anyway.
PLAIN_TEXT_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "Answer: ",
    "fields": {"content": {"close_pattern": r"$", "content": "text"}},
}
SEEDS_DEFAULT = (42, 43)  # ~7 min a seed on the 2-core box: two fit the 20-minute budget


def bench_overrides(workdir: Path, max_steps: int, seed: int) -> list[str]:
    """The config both trainers share: tiny-cpu, its fleet accepting TRL's and the bench's adapter folders."""
    trusted = [str(workdir / "trl" / ".vllm_lora"), str(workdir / "spotrl" / "bench" / "bucket" / "adapters")]
    return [
        f"train.max_steps={max_steps}",
        f"train.seed={seed}",
        f"logging.output_dir={workdir / 'spotrl'}",
        "logging.run_name=bench",
        f"bucket.url=file://{workdir / 'spotrl' / 'bench' / 'bucket'}",
        f"bucket.cache_dir={workdir / 'cache'}",
        f"bucket.keep_versions={max_steps + 2}",  # keep every step's adapter for the evaluation
        "logging.report_to=[jsonl, ray]",
        "logging.progress_bar=false",
        f"fleet.extra_adapter_dirs={json.dumps(trusted)}",
    ]


def checkpoint_rows(points: dict[int, dict], base_accuracy: float) -> list[dict]:
    """Per measured step: accuracy, gain over the base, wall time and gain per 1k samples."""
    rows = []
    for step in sorted(points):
        p = points[step]
        gain = p["accuracy"] - base_accuracy
        rows.append({"step": step, **p, "gain": gain, "gain_per_1k_samples": 1000 * gain / p["samples"]})
    return rows


# ---- evaluation (the same for both trainers) ------------------------------------------------------------


def adapter_folder(root: Path) -> Path:
    """The folder holding adapter_config.json under `root` (a bucket version puts it in a commit-id folder)."""
    return next(p.parent for p in sorted(root.rglob("adapter_config.json")))


def evaluate_folder(cfg, url: str, model_path: str, name: str, folder: Path) -> float:
    """Held-out greedy accuracy of the adapter in `folder`, served by the fleet under `name` for the call."""
    from app.evaluate import evaluate
    from app.fleet_client import FleetClient

    fleet = FleetClient(url)
    fleet.load_adapter(name, str(folder))
    try:
        return evaluate(cfg, url, model_path, name)["accuracy"]
    finally:
        fleet.unload_adapter(name)


# ---- spotrl side ----------------------------------------------------------------------------------------


def run_spotrl(cfg, url: str, model_path: str, steps: list[int], label: str = "spotrl") -> dict[int, dict]:
    """`launch.train.train` on the running fleet, then evaluate its bucket versions at `steps` (printed as `label`'s)."""
    import core.local_ray
    from launch.train import train

    # The Ray of this process already hosts the shared fleet: the driver joins it instead of starting one.
    core.local_ray.start_ray = lambda address, offline=True: False
    summary = train(cfg, address="this-process")
    history = read_metrics(cfg.run_dir)
    times = {h["step"]: h["time"] for h in history}
    adapters = Path(cfg.bucket.url.removeprefix("file://")) / "adapters"
    points = {}
    for step in steps:
        wall = summary["loop_wall_s"] - (times[max(times)] - times[step])  # loop time up to the end of `step`
        folder = adapter_folder(adapters / f"policy-v{step}")
        acc = evaluate_folder(cfg, url, model_path, f"spotrl-step-{step}", folder)
        points[step] = {"accuracy": acc, "wall_s": round(wall, 1), "samples": step * samples_per_step(cfg)}
        print(f"{label} step {step}: held-out {acc:.3f}, loop {wall:.1f} s", flush=True)
    return points


def samples_per_step(cfg) -> int:
    return cfg.train.num_prompts_per_step * cfg.sampling.num_generations


# ---- TRL side (a child process, so that its patches never touch spotrl) ------------------------------------


def patch_trl_for_cpu() -> None:
    """The two CPU-only obstacles of TRL 1.16's AsyncGRPOTrainer; nothing else is changed."""
    import torch
    import torch.nn.functional as F
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    # 1. Its MFU metric looks the peak FLOPs up by `torch.cuda.get_device_name`, which fails without CUDA.
    async_grpo_trainer.get_peak_flops_per_device = lambda *args, **kwargs: None

    # 2. Its packed (tree) attention downloads a flash-attention kernel from the hub; offline and on the CPU we
    #    give it the same varlen call in plain torch: per segment, causal aligned bottom-right as in FA.
    class CpuVarlen:
        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, **_):
            out = torch.empty_like(q)
            groups = q.shape[1] // k.shape[1]
            for i in range(len(cu_q) - 1):
                qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
                qi = q[qs:qe].transpose(0, 1)
                ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
                vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
                lq, lk = qe - qs, ke - ks
                mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq) if causal else None
                out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(
                    0, 1
                )
            return out

    packing._flash_attn = lambda: CpuVarlen


class ExactAnswerOfIds:
    """spotrl's `exact_answer` on the completion's token ids, decoded as the fleet decodes them for spotrl.

    TRL hands completions as parsed messages; scoring the ids keeps both trainers' rewards identical."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.__name__ = "exact_answer"

    def __call__(self, completions, completion_ids, answer, **_) -> list[float]:
        from app.tasks.rewards import exact_answer

        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return exact_answer(texts, None, completion_ids, answer=answer)


def trl_main(args) -> None:
    """Train with TRL against the fleet at `args.url`; save the adapter at each step of `args.steps`."""
    patch_trl_for_cpu()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from app.kinds.registry import problems_of
    from bench.vs_trl import ExactAnswerOfIds  # by module name: TRL pickles the reward into its rollout process
    from core.config import load_config

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", args.overrides)
    t, s, grpo = cfg.train, cfg.sampling, cfg.objectives[0]  # tiny-cpu's objectives: GRPO alone
    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.chat_template = RAW_PROMPT_TEMPLATE
    tokenizer.response_template = PLAIN_TEXT_RESPONSE
    train = problems_of(cfg).train
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p.prompt}] for p in train], "answer": [p.answer for p in train]}
    )
    trl_args = AsyncGRPOConfig(
        output_dir=str(out),
        vllm_server_base_url=args.url,
        learning_rate=t.learning_rate,
        num_generations=s.num_generations,
        max_completion_length=s.max_completion_length,
        temperature=s.temperature,
        epsilon=grpo.epsilon,
        epsilon_high=grpo.epsilon_high,
        max_staleness=cfg.rollout.max_staleness,
        weight_sync_steps=cfg.learner.weight_sync_steps,
        max_steps=max(args.steps),
        seed=t.seed,
        # Same samples per optimizer step as spotrl (16 prompts x G): one fixed-count micro-batch.
        token_budget=0,
        per_device_train_batch_size=samples_per_step(cfg),
        gradient_accumulation_steps=1,
        bf16=False,  # fp32 on the CPU, like our learner
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
    )
    lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules="all-linear", task_type="CAUSAL_LM")
    wall: dict[int, float] = {}

    class SaveAt(TrainerCallback):
        """Saves the adapter at the measured steps; the saving time is left out of the wall time."""

        def on_train_begin(self, *_a, **_k):
            self.t0, self.paused = time.time(), 0.0

        def on_step_end(self, _args, state, _control, model=None, **_k):
            if state.global_step in args.steps:
                wall[state.global_step] = time.time() - self.t0 - self.paused
                t = time.time()
                model.save_pretrained(out / ".vllm_lora" / f"bench-step-{state.global_step}")
                self.paused += time.time() - t

    trainer = AsyncGRPOTrainer(
        model=args.model_path,
        reward_funcs=ExactAnswerOfIds(tokenizer),
        args=trl_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[SaveAt()],
    )
    trainer.train()
    (out / "wall.json").write_text(json.dumps(wall))


def run_trl(cfg, overrides: list[str], url: str, model_path: str, steps: list[int], workdir: Path) -> dict[int, dict]:
    out = workdir / "trl"
    cmd = [sys.executable, "-m", "bench.vs_trl", "--trl-worker", "--url", url, "--model-path", model_path]
    cmd += ["--out", str(out), "--steps", *map(str, steps), *(a for s in overrides for a in ("--set", s))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log_path = workdir / "trl.log"
    print(f"running TRL (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed:\n{log_path.read_text()[-4000:]}")
    wall = {int(k): v for k, v in json.loads((out / "wall.json").read_text()).items()}
    points = {}
    for step in steps:
        folder = out / ".vllm_lora" / f"bench-step-{step}"
        acc = evaluate_folder(cfg, url, model_path, f"trl-step-{step}", folder)
        points[step] = {"accuracy": acc, "wall_s": round(wall[step], 1), "samples": step * samples_per_step(cfg)}
        print(f"TRL step {step}: held-out {acc:.3f}, loop {wall[step]:.1f} s", flush=True)
    return points


# ---- the run ----------------------------------------------------------------------------------------------


def run_seed(seed: int, steps: list[int], port: int) -> dict:
    """One fleet on the Ray already started, both trainers (spotrl first, then TRL), evaluated alike."""
    from app.evaluate import base_model_name, evaluate
    from app.fleet_client import FleetClient
    from core.config import load_config
    from deployments.fleet import deploy_fleet, shutdown_fleet
    from tiny.build import prepare_model

    workdir = Path(tempfile.mkdtemp(prefix="spotrl-vs-trl-"))
    (workdir / "trl" / ".vllm_lora").mkdir(parents=True)
    (workdir / "spotrl" / "bench" / "bucket" / "adapters").mkdir(parents=True)
    # Serve's proxy keeps the port it started on: every seed's fleet gets the same one.
    overrides = [*bench_overrides(workdir, max(steps), seed), f"fleet.port={port}"]
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    model_path = prepare_model(cfg.model, cfg.task)
    try:
        url = deploy_fleet(cfg.own_fleet(), model_path)
        base = evaluate(cfg, url, model_path, base_model_name(FleetClient(url)))["accuracy"]
        print(f"seed {seed}: base held-out {base:.3f}", flush=True)
        spotrl = run_spotrl(cfg, url, model_path, steps)
        trl = run_trl(cfg, overrides, url, model_path, steps, workdir)
    finally:
        shutdown_fleet(cfg, stop_serve=False)
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "seed": seed,
        "base_accuracy": base,
        "spotrl": checkpoint_rows(spotrl, base),
        "trl": checkpoint_rows(trl, base),
    }


def run_seeds(seeds: list[int], steps: list[int]) -> list[dict]:
    """One loopback Ray for the whole run (a second `ray.init` in this process would join the first's
    address, which Ray leaves in the environment), a fresh fleet and bucket per seed."""
    import ray

    from core.local_ray import start_ray

    start_ray(None, offline=True)
    try:
        port = free_port()
        return [run_seed(seed, steps, port) for seed in seeds]
    finally:
        ray.shutdown()


def table_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for run in runs:
        for ours, theirs in zip(run["spotrl"], run["trl"], strict=True):
            rows.append(
                [
                    f"seed {run['seed']} step {ours['step']} ({ours['samples']} samples)",
                    f"{ours['accuracy']:.3f} ({ours['gain']:+.3f})",
                    f"{theirs['accuracy']:.3f} ({theirs['gain']:+.3f})",
                    f"{ours['gain'] - theirs['gain']:+.3f}",
                    f"{ours['wall_s']:.1f}",
                    f"{theirs['wall_s']:.1f}",
                    f"{theirs['wall_s'] / ours['wall_s']:.1f}x" if ours["wall_s"] > 0 else "-",
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 20, 30])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS_DEFAULT))
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.trl_worker:
        trl_main(args)
        return
    steps = sorted(set(args.steps))
    runs = run_seeds(args.seeds, steps)
    headers = ["point", "spotrl held-out (gain)", "TRL held-out (gain)", "gain diff", "spotrl s", "TRL s", "TRL/spotrl"]
    print_table(headers, table_rows(runs), title="spotrl vs TRL AsyncGRPOTrainer: same fleet, samples and settings")
    final = [(r["spotrl"][-1], r["trl"][-1]) for r in runs]
    ratio = math.exp(sum(math.log(t["wall_s"] / s["wall_s"]) for s, t in final) / len(final))
    print(f"\nTRL / spotrl loop wall time at step {steps[-1]} (geometric mean over seeds): {ratio:.1f}x")
    path = write_result("vs_trl", {"steps": steps, "seeds": args.seeds, "runs": runs, "wall_ratio_final": ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
