"""The learner's training step on one GPU at the seed recipe's shapes: tokens/s, step time, peak memory, MFU.

bench.learner times the learner on a CPU at toy sizes; this times it at the size it is meant for.
A random model with Qwen2.5-1.5B's exact shapes (hidden 1536, MLP 8960, 28
layers, 12 query and 2 KV heads, vocabulary 151,936, tied embeddings; random weights cost the same
FLOPs as trained ones), rank-1 LoRA on every linear layer, bfloat16 compute with fp32 LoRA masters
(FSDP2 mixed precision on a process group of one, as a single-GPU learner runs), packed rows of
16,384 tokens, and steps shaped like the seed's: 16 prompts of 200 tokens x 8 completions of 750 to
1,250 tokens (about 1,000) = 128 samples, about 154k tokens. One warm-up step, then 5 timed ones.

It drives the real `LearnerRank` (`setup`, `prepare_training`, then per step `forward_backward` and
`optimizer_step`: a training step without the bucket), with a plain namespace of the seed recipe's
values in place of `RunConfig`, because the GPU benchmark box has torch, transformers, peft,
accelerate, safetensors and numpy but no pydantic, Ray or vLLM, and no network. Nothing this imports
needs them (tests/integration/test_bench_learner_gpu.py runs it with them blocked, and checks that the
namespace still holds the seed config's values).

    python -m bench.learner_gpu [--steps 5] [--warmup 1] [--out DIR]     # the GPU run
    python -m bench.learner_gpu --small                                  # tiny shapes, any device: a smoke test

The GPU run, from a copy of the repository's working tree on the GPU box (nothing to install or
carry beyond the tree: app/ and bench/ are all it imports). On an H200 it took 75 s (imports, a 3 GB model built and
loaded, 6 steps of ~154k tokens, then the Tinker leg; 207 s before the attention fix); the timeout keeps it under 8:

    timeout 470 python3 -m bench.learner_gpu --out "$OUT"      # then copy $OUT/*.json to bench/results/

Writes DIR/learner_gpu.json (default bench/results; `--small` writes learner_gpu_small.json, so CPU
figures never land where the GPU's belong) and prints a table. Without CUDA and without `--small` it
prints "no CUDA device: skipped" and writes nothing (that is what `make bench` does on a CPU box).
MFU is quoted against the spec-sheet dense bf16 peak of the GPU it finds (`app.learner.perf`).

Then, on the same model folder, the Tinker API's learner (`app.learner.tinker_learner`, what `python -m launch.tinker
--learner-device cuda --learner-dtype bfloat16` runs): one client's `forward_backward` (`importance_sampling`) over 8
datums of 950-1,450 tokens and its `optim_step`, LoRA rank 32; written as tinker_learner_gpu.json (`--small`:
tinker_learner_gpu_small.json). It runs after learner_gpu.json is written, and an error in it is written as its result
instead of ending the run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import fmt_bytes, fmt_seconds, print_table, write_result

# What LearnerRank reads of a RunConfig, with configs/qwen2.5-math-1.5b.yaml's values (the test compares them).
SEED_RECIPE = {
    "model": {"dtype": "bfloat16", "revision": None},
    "lora": {"rank": 1, "alpha": 2.0, "dropout": 0.0, "target_modules": "all-linear"},
    "sampling": {"temperature": 1.0},
    "train": {
        "learning_rate": 4e-5,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_steps": 500,
        "seed": 42,
    },
    "learner": {
        "weight_sync_steps": 4,
        "device": "cuda",
        "batching": "packed",
        "token_budget": 16384,
        "per_device_train_batch_size": 16,
        "gradient_checkpointing": False,
        "logprob_chunk_tokens": 1024,
        "peak_flops": {"cpu": 1e11},
    },
}
QWEN25_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
}
SMALL_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
# Steps: prompts per step, completions per prompt, prompt tokens, completion tokens (uniform in the range).
SEED_STEP = {"prompts": 16, "group_size": 8, "prompt_tokens": 200, "completion_tokens": (750, 1250)}
SMALL_STEP = {"prompts": 2, "group_size": 4, "prompt_tokens": 16, "completion_tokens": (24, 72)}
SMALL_TOKEN_BUDGET = 256
# The Tinker API's learner: one client's forward_backward (`importance_sampling`) over an RL step's datums, then its
# optim_step; rank 32, the SDK's default.
TINKER_STEP = {"datums": 8, "tokens": (950, 1450), "rank": 32}
SMALL_TINKER_STEP = {"datums": 2, "tokens": (40, 88), "rank": 8}


# The seed recipe's `objectives`: GRPO alone, with its clip and importance sampling.
SEED_OBJECTIVES = [
    {
        "kind": "grpo",
        "weight": 1.0,
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "vllm_importance_sampling_correction": False,
        "vllm_importance_sampling_cap": 2.0,
        "sequence_is": "off",  # the off-policy guards beyond TIS, off as in the recipe
        "sequence_is_low": 0.5,
        "sequence_is_high": 2.0,
        "token_mask": False,
        "token_mask_low": 0.5,
        "token_mask_high": 2.0,
    }
]


def bench_config(**learner) -> SimpleNamespace:
    """The seed recipe as attribute access (`cfg.sampling.temperature`), learner fields overridden."""
    sections = {**SEED_RECIPE, "learner": {**SEED_RECIPE["learner"], **learner}}
    cfg = SimpleNamespace(**{name: SimpleNamespace(**values) for name, values in sections.items()})
    cfg.objectives = [SimpleNamespace(**spec) for spec in SEED_OBJECTIVES]
    return cfg


def make_groups(step: dict, vocab: int, seed: int, objectives):
    """One step's scored groups: random tokens, lengths as `step` says, rewards half 0 half 1 (advantages != 0),
    annotated by `objectives` as the rollout annotates them.

    Sampling log-probs are log(1/vocab), near what a random model gives any token, so ratios sit near 1."""
    from contracts.rollouts import Group, Sample

    rng = random.Random(seed)
    logp = -math.log(vocab)
    groups = []
    for g in range(step["prompts"]):
        prompt = [rng.randrange(1, vocab) for _ in range(step["prompt_tokens"])]
        samples = []
        for i in range(step["group_size"]):
            n = rng.randint(*step["completion_tokens"])
            samples.append(Sample([rng.randrange(1, vocab) for _ in range(n)], [logp] * n, float(i % 2)))
        groups.append(objectives.annotate(Group(seed * step["prompts"] + g, f"p{g}", prompt, 0, samples)))
    return groups


def build_model(folder: Path, shape: dict, device: str, dtype) -> str:
    """A random Qwen2 of `shape` with tied embeddings, saved as a model folder (initialised on `device`: fast)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **shape, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_sliding_window=False
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the learner loads its own copy: leave it the whole GPU
    return str(folder)


def run_steps(learner, step: dict, vocab: int, warmup: int, steps: int) -> list[dict]:
    """Warm-up steps, then timed ones: each `forward_backward` + `optimizer_step`, as `train_step` runs them."""
    import torch

    from app.objectives import Objectives

    objectives = Objectives.from_config(learner.cfg)
    cuda = learner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = []
    for i in range(-warmup, steps):
        groups = make_groups(step, vocab, 1000 + i, objectives)
        if i == 0 and cuda:
            torch.cuda.reset_peak_memory_stats()  # the timed steps' peak, not the warm-up's first-call allocations
        sync()
        t0 = time.perf_counter()
        metrics = learner.forward_backward(groups)
        metrics.update(learner.optimizer_step())
        sync()
        step_s = time.perf_counter() - t0
        metrics.update(learner.perf_metrics(metrics, step_s))
        metrics["perf/mfu_step"] = metrics["perf/mfu_fwd_bwd"] * metrics["perf/fwd_bwd_s"] / step_s
        metrics["perf/forwarded_tok_s"] = metrics["batch/real_tokens"] / step_s
        print(f"  {'warm-up' if i < 0 else f'step {i + 1}/{steps}'}: {fmt_seconds(step_s)}", flush=True)
        if i >= 0:
            runs.append(metrics)
    return runs


def summarize(runs: list[dict], learner) -> dict:
    def median(key: str) -> float:
        return statistics.median(m[key] for m in runs)

    return {
        "step_s": median("perf/step_s"),
        "step_s_all": [m["perf/step_s"] for m in runs],
        "fwd_bwd_s": median("perf/fwd_bwd_s"),
        "optimizer_s": median("perf/optimizer_s"),
        "trained_tok_s": median("perf/trained_tok_s"),
        "forwarded_tok_s": median("perf/forwarded_tok_s"),
        "mfu_fwd_bwd_percent": median("perf/mfu_fwd_bwd"),
        "mfu_step_percent": median("perf/mfu_step"),
        "trained_tokens": median("batch/trained_tokens"),
        "forwarded_tokens": median("batch/real_tokens"),
        "samples": median("batch/samples"),
        "microbatches": median("batch/microbatches"),
        "row_fill_frac": median("batch/row_fill_frac"),
        "loss": [m["loss"] for m in runs],
        "ratio": median("ratio"),
        **peak_memory(learner.device.type == "cuda"),
    }


def peak_memory(cuda: bool) -> dict:
    """The peak since the timed steps began (CUDA's allocator, its stats reset at the first timed step), or the
    process's peak RSS on the CPU."""
    import torch

    if cuda:
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(),
            "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
            "memory_measure": "torch.cuda.max_memory_allocated over the timed steps",
        }
    return {
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_measure": "peak RSS of the process",
    }


def versions() -> dict:
    import peft
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="Tiny model and steps (a smoke test, any device).")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one).")
    parser.add_argument("--steps", type=int, default=None, help="Timed steps (default 5; 2 with --small).")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed steps first.")
    parser.add_argument("--out", default=None, help="Results folder (default bench/results).")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download, and no network there
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.small and not (device == "cuda" and torch.cuda.is_available()):
        print("no CUDA device: skipped")  # the full shapes are for a GPU: never a CPU figure in their place
        return
    from app.learner.rank import LearnerRank

    shape, step = (SMALL_MODEL, SMALL_STEP) if args.small else (QWEN25_1_5B, SEED_STEP)
    steps = args.steps or (2 if args.small else 5)
    # bfloat16 as the GPU learner runs it; float32 on the CPU, whose bfloat16 matmuls are pathologically slow.
    dtype = "bfloat16" if device == "cuda" else "float32"
    small = {"token_budget": SMALL_TOKEN_BUDGET, "logprob_chunk_tokens": 64}  # several rows, several chunks
    cfg = bench_config(device=device, **(small if args.small else {}))
    cfg.model.dtype = dtype
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-learner-gpu-") as workdir:
        t0 = time.perf_counter()
        model_path = build_model(Path(workdir) / "model", shape, device, getattr(torch, dtype))
        build_s = time.perf_counter() - t0
        learner = LearnerRank(cfg, model_path)
        try:
            t0 = time.perf_counter()
            learner.setup()
            learner.prepare_training()
            load_s = time.perf_counter() - t0
            runs = run_steps(learner, step, shape["vocab_size"], args.warmup, steps)
            summary = summarize(runs, learner)
        finally:
            learner.close()
        report(args, learner, shape, step, steps, summary, {"build_model_s": build_s, "load_and_shard_s": load_s})
        del learner
        if device == "cuda":
            torch.cuda.empty_cache()
        tinker_leg(args, model_path, device, dtype, shape["vocab_size"], steps)


def tinker_leg(args, model_path: str, device: str, dtype: str, vocab: int, steps: int) -> None:
    """The Tinker API's learner (`app.learner.tinker_learner`: a bfloat16 base under fp32 adapters on a GPU) on the
    same model, written as a result of its own. It runs after the learner's result is written, and whatever goes
    wrong in it is printed and written as its result: the one GPU run must never lose the learner's figures to it."""
    name = "tinker_learner_gpu_small" if args.small else "tinker_learner_gpu"
    step = SMALL_TINKER_STEP if args.small else TINKER_STEP
    try:
        data = run_tinker_steps(model_path, device, dtype, vocab, step, args.warmup, steps)
    except Exception as exc:  # noqa: BLE001 - reported, see above
        print(f"tinker learner: {type(exc).__name__}: {exc}")
        data = {"error": f"{type(exc).__name__}: {exc}"}
    data = {"device": device, "dtype": dtype, "step": step, "steps": steps, "versions": versions(), **data}
    print(f"wrote {write_result(name, data, Path(args.out) if args.out else None)}")


def run_tinker_steps(model_path: str, device: str, dtype: str, vocab: int, step: dict, warmup: int, steps: int) -> dict:
    """Warm-up steps, then timed ones of one Tinker client: `forward_backward` then `optim_step`, random datums."""
    import torch

    from app.learner.tinker_learner import TinkerLearner
    from contracts.tinker import AdamStep, AdapterSpec, Datum, LossCall

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    learner = TinkerLearner(model_path, max_models=1, device=device, dtype=dtype)
    learner.create("bench", AdapterSpec(rank=step["rank"], seed=0))
    load_s = time.perf_counter() - t0
    rng, logp = random.Random(7), -math.log(vocab)
    runs = []
    for i in range(-warmup, steps):
        data = []
        for d in range(step["datums"]):
            n = rng.randint(*step["tokens"])
            tokens = [rng.randrange(1, vocab) for _ in range(n + 1)]
            inputs = {"logprobs": [logp] * n, "advantages": [1.0 if d % 2 else -1.0] * n}
            data.append(Datum(tokens[:-1], tokens[1:], inputs))
        if i == 0 and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        reply = learner.forward_backward(LossCall("bench", data, "importance_sampling"))
        sync()
        t1 = time.perf_counter()
        learner.optim_step(AdamStep("bench", 4e-5, 0.9, 0.95, 1e-8, 0.0, 1.0))
        sync()
        t2 = time.perf_counter()
        print(f"  tinker {'warm-up' if i < 0 else f'step {i + 1}/{steps}'}: {fmt_seconds(t2 - t0)}", flush=True)
        if i >= 0:
            tokens = sum(len(d.input_tokens) for d in data)
            runs.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "tok_s": tokens / (t2 - t0), "loss": reply.metrics})
    summary = {
        "load_s": load_s,
        "step_s": statistics.median(r["step_s"] for r in runs),
        "step_s_all": [r["step_s"] for r in runs],
        "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in runs),
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "loss": [r["loss"]["loss:sum"] for r in runs],
        **peak_memory(cuda),
    }
    print_table(
        ["step", "fwd+bwd", "tok/s", "peak memory"],
        [
            [
                fmt_seconds(summary["step_s"]),
                fmt_seconds(summary["fwd_bwd_s"]),
                f"{summary['tok_s']:.0f}",
                fmt_bytes(summary["peak_memory_bytes"]),
            ]
        ],
        title=f"Tinker learner on {device} ({dtype} base, fp32 LoRA r{step['rank']}): one client, "
        f"{step['datums']} datums of {step['tokens'][0]}-{step['tokens'][1]} tokens (median of {steps} steps)",
    )
    return summary


def report(args, learner, shape: dict, step: dict, steps: int, summary: dict, setup_s: dict) -> None:
    """Print the table and write the result file."""
    cfg = learner.cfg
    title = (
        f"Learner step on {learner.device_name}: {'small' if args.small else 'Qwen2.5-1.5B'} shapes, "
        f"{cfg.model.dtype}, LoRA r{cfg.lora.rank}, {step['prompts']}x{step['group_size']} samples, "
        f"token_budget {cfg.learner.token_budget}"
    )
    print_table(
        ["step", "fwd+bwd", "optimizer", "trained tok/s", "forwarded tok/s", "MFU fwd+bwd", "MFU step", "peak memory"],
        [
            [
                fmt_seconds(summary["step_s"]),
                fmt_seconds(summary["fwd_bwd_s"]),
                fmt_seconds(summary["optimizer_s"]),
                f"{summary['trained_tok_s']:.0f}",
                f"{summary['forwarded_tok_s']:.0f}",
                f"{summary['mfu_fwd_bwd_percent']:.1f}%",
                f"{summary['mfu_step_percent']:.1f}%",
                fmt_bytes(summary["peak_memory_bytes"]),
            ]
        ],
        title=f"{title} (median of {steps} steps; MFU against {learner.peak_flops:.4g} FLOP/s"
        + (", the spec-sheet dense bf16 peak)" if learner.device.type == "cuda" else ")"),
    )
    config = {
        "model": shape,
        "tie_word_embeddings": True,
        "dtype": cfg.model.dtype,
        "lora_rank": cfg.lora.rank,
        "token_budget": cfg.learner.token_budget,
        "logprob_chunk_tokens": cfg.learner.logprob_chunk_tokens,
        "step": step,
        "steps": steps,
        "warmup": args.warmup,
        "world_size": learner.world_size,
    }
    device = {"device": learner.device.type, "device_name": learner.device_name, "peak_flops": learner.peak_flops}
    data = {**device, "versions": versions(), "config": config, "setup_s": setup_s, **summary}
    path = write_result(
        "learner_gpu_small" if args.small else "learner_gpu", data, Path(args.out) if args.out else None
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
