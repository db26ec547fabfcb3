"""Learner step time: padding-free packing vs fixed-count padded batches, with and without gradient checkpointing.

The same GRPO-like steps (8 prompts x 8 completions each; prompts of 30-80 tokens, completions
log-normal around 80 tokens with a tenth cut at the 256-token limit, as real completions spread) are
trained by the real `LearnerRank` on a small random Qwen2. Each variant runs in its own process, so its
peak memory is its own, and their steps are interleaved, so other load on the machine slows them
alike. Packing removes the pad tokens a padded batch forwards; gradient checkpointing trades
recomputation for activation memory.

    python -m bench.learner [--steps 3] [--groups 8] [--threads 1]

Writes bench/results/learner.json and prints a table: step time (median), pad fraction, row fill,
samples per row, trained tokens/s, peak RSS, and the padded/packed step-time ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import random
import resource
import statistics
import tempfile
from pathlib import Path

from bench.common import fmt_bytes, print_table, write_result

VARIANTS = [
    ("packed", False),
    ("padded", False),
    ("packed", True),
    ("padded", True),
]
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
}
MAX_COMPLETION = 256
TOKEN_BUDGET = 2048
PADDED_BATCH = 16


def make_groups(n_groups: int, group_size: int, seed: int, objectives):
    """Scored groups whose lengths spread like GRPO completions on math: mostly medium, a tail at the limit,
    annotated by `objectives` as the rollout annotates them."""
    from contracts.rollouts import Group, Sample

    rng = random.Random(seed)
    vocab = MODEL["vocab_size"]
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(30, 80))]
        samples = []
        for _ in range(group_size):
            truncated = rng.random() < 0.1
            n = MAX_COMPLETION if truncated else max(4, min(MAX_COMPLETION, int(rng.lognormvariate(4.4, 0.6))))
            samples.append(
                Sample(
                    [rng.randrange(1, vocab) for _ in range(n)],
                    [-7.6] * n,
                    float(rng.random() < 0.4),
                    truncated=truncated,
                )
            )
        group = Group(seed * n_groups + g, f"p{g}", prompt, 0, samples)  # ids unique across steps
        groups.append(objectives.annotate(group))
    return groups


def build_model(folder: Path) -> str:
    from tiny.network import random_qwen2

    random_qwen2(**MODEL, max_position_embeddings=512).save_pretrained(folder)
    return str(folder)


_learner = None  # the variant a worker process trains (one variant per process)


def start_variant(batching: str, checkpointing: bool, model_path: str, workdir: str, threads: int) -> int:
    """Build this process's learner for one variant; returns its resident memory before any step."""
    import torch

    from app.learner.rank import LearnerRank
    from core.config import RunConfig

    global _learner
    torch.set_num_threads(threads)
    cfg = RunConfig()
    cfg.lora.rank, cfg.lora.alpha = 1, 2.0  # the seed recipe
    cfg.learner.batching = batching
    cfg.learner.gradient_checkpointing = checkpointing
    cfg.learner.token_budget = TOKEN_BUDGET
    cfg.learner.per_device_train_batch_size = PADDED_BATCH
    cfg.learner.weight_sync_steps = cfg.learner.save_steps = 10**6  # time the step, not the bucket
    cfg.bucket.url = f"file://{workdir}/bucket-{batching}-{int(checkpointing)}"
    cfg.bucket.cache_dir = f"{workdir}/cache"
    _learner = LearnerRank(cfg, model_path)
    _learner.setup()
    _learner.start()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def step_variant(groups: int, seed: int) -> dict:
    """One training step of this process's variant; its metrics and the process's peak RSS so far."""
    from app.objectives import Objectives
    from contracts.rollouts import RolloutBatch

    batch = RolloutBatch(make_groups(groups, 8, seed, Objectives.from_config(_learner.cfg)))
    metrics = _learner.train_step(batch).metrics
    return {**metrics, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def summarize_variant(batching: str, checkpointing: bool, runs: list[dict]) -> dict:
    def median(key: str) -> float:
        return statistics.median(m[key] for m in runs)

    return {
        "batching": batching,
        "gradient_checkpointing": checkpointing,
        "step_s": median("perf/step_s"),
        "fwd_bwd_s": median("perf/fwd_bwd_s"),
        "step_s_all": [m["perf/step_s"] for m in runs],
        "trained_tok_s": median("perf/trained_tok_s"),
        "pad_frac": median("batch/pad_frac"),
        "row_fill_frac": median("batch/row_fill_frac"),
        "samples_per_row": median("batch/samples_per_row"),
        "microbatches": median("batch/microbatches"),
        "forwarded_tokens": median("batch/forwarded_tokens"),
        "trained_tokens": median("batch/trained_tokens"),
        "peak_rss_bytes": max(m["peak_rss_bytes"] for m in runs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per variant (after one warm-up step).")
    parser.add_argument("--groups", type=int, default=8, help="Prompts per step (8 completions each).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per variant.")
    args = parser.parse_args(argv)

    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-learner-") as workdir:
        model_path = build_model(Path(workdir) / "model")
        # One process per variant (peak RSS is per process), and their steps interleaved round-robin, so that
        # other work on the machine slows every variant alike instead of whichever happened to run then.
        pools = [concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) for _ in VARIANTS]
        try:
            for pool, (batching, checkpointing) in zip(pools, VARIANTS, strict=True):
                pool.submit(start_variant, batching, checkpointing, model_path, workdir, args.threads).result()
            runs: list[list[dict]] = [[] for _ in VARIANTS]
            for step in range(-1, args.steps):  # step -1 warms up: allocator, first-call overheads
                for i, pool in enumerate(pools):
                    metrics = pool.submit(step_variant, args.groups, 1000 + step).result()
                    if step >= 0:
                        runs[i].append(metrics)
                print(f"  step {step + 1}/{args.steps} done" if step >= 0 else "  warm-up done", flush=True)
        finally:
            for pool in pools:
                pool.shutdown()
    results = [summarize_variant(b, c, r) for (b, c), r in zip(VARIANTS, runs, strict=True)]

    by = {(r["batching"], r["gradient_checkpointing"]): r for r in results}
    summary = {
        "padded_over_packed_step_time": by["padded", False]["step_s"] / by["packed", False]["step_s"],
        "padded_over_packed_step_time_checkpointing": by["padded", True]["step_s"] / by["packed", True]["step_s"],
        "pad_frac_padded": by["padded", False]["pad_frac"],
        "pad_frac_packed": by["packed", False]["pad_frac"],
        "checkpointing_over_plain_step_time_packed": by["packed", True]["step_s"] / by["packed", False]["step_s"],
        "checkpointing_over_plain_peak_rss_packed": by["packed", True]["peak_rss_bytes"]
        / by["packed", False]["peak_rss_bytes"],
    }
    rows = [
        [
            f"{r['batching']}{' + ckpt' if r['gradient_checkpointing'] else ''}",
            f"{r['step_s']:.2f} s",
            f"{r['fwd_bwd_s']:.2f} s",
            f"{r['pad_frac']:.1%}",
            f"{r['row_fill_frac']:.1%}",
            f"{r['samples_per_row']:.1f}",
            f"{r['microbatches']:.0f}",
            f"{r['trained_tok_s']:.0f}",
            fmt_bytes(r["peak_rss_bytes"]),
        ]
        for r in results
    ]
    print_table(
        ["variant", "step", "fwd+bwd", "pad", "row fill", "samples/row", "micro-batches", "trained tok/s", "peak RSS"],
        rows,
        title=f"Learner step, {args.groups} prompts x 8 completions, random Qwen2 {MODEL['hidden_size']}x"
        f"{MODEL['num_hidden_layers']}, LoRA r1, token_budget {TOKEN_BUDGET}, padded batch {PADDED_BATCH}",
    )
    print(
        f"\npadded/packed step time: {summary['padded_over_packed_step_time']:.2f}x "
        f"(pad fraction {summary['pad_frac_padded']:.1%} vs {summary['pad_frac_packed']:.1%}); "
        f"gradient checkpointing costs {summary['checkpointing_over_plain_step_time_packed']:.2f}x step time"
    )
    path = write_result(
        "learner",
        {
            "config": {
                "model": MODEL,
                "groups": args.groups,
                "group_size": 8,
                "steps": args.steps,
                "token_budget": TOKEN_BUDGET,
                "padded_batch": PADDED_BATCH,
                "max_completion": MAX_COMPLETION,
                "threads": args.threads,
            },
            "summary": summary,
            "variants": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
