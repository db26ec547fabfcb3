"""Where the GPU learner's step goes: one seed-shaped step under torch.profiler, and an attention probe.

bench.learner_gpu measured the learner's step on an H200 at 7% MFU (21.8 s for ~154k tokens, where the
matmuls alone would take ~2 s at the measured bf16 rate): this says which kernels take the time. It builds the
same model and steps as bench.learner_gpu (its functions), runs one warm-up step, then one step under the
profiler, and writes the kernels by device time (and the host ops by CPU time) to DIR/learner_gpu_profile.txt.

Then it times causal sdpa forward+backward at one packed sample's shape (12 query heads, 2 KV heads, head_dim
128, ~1,000 tokens) three ways: with `enable_gqa` (what transformers' sdpa path passes when there is no mask),
with the KV heads repeated first, and pinned to the flash backend; a slow first way would be the packed
attention's cost.

    timeout 300 python3 -m bench.learner_gpu_profile --out "$OUT"
    python -m bench.learner_gpu_profile --small          # tiny shapes on the CPU: a smoke test

Profiles are diagnostics, not results: nothing is written to bench/results unless --out says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.learner_gpu import (
    QWEN25_1_5B,
    SEED_STEP,
    SMALL_MODEL,
    SMALL_STEP,
    SMALL_TOKEN_BUDGET,
    bench_config,
    build_model,
    make_groups,
)


def profile_step(learner, step: dict, vocab: int, rows: int) -> str:
    """One warm-up step, then one profiled step: the top kernels by device time and host ops by CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.objectives import Objectives

    objectives = Objectives.from_config(learner.cfg)
    cuda = learner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    learner.forward_backward(make_groups(step, vocab, 999, objectives))
    learner.optimizer_step()
    sync()
    groups = make_groups(step, vocab, 1000, objectives)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        metrics = learner.forward_backward(groups)
        learner.optimizer_step()
        sync()
    wall = time.perf_counter() - t0
    table = prof.key_averages()
    sections = [f"profiled step: {wall:.2f} s wall (profiler on), fwd_bwd {metrics['perf/fwd_bwd_s']:.2f} s"]
    if cuda:
        for key in ("self_device_time_total", "self_cuda_time_total"):  # the name changed across torch versions
            try:
                sections.append(table.table(sort_by=key, row_limit=rows, max_name_column_width=90))
                break
            except (AttributeError, KeyError, ValueError):
                continue
    sections.append(table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90))
    return "\n\n".join(sections)


def attention_probe(device: str, dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    """Median seconds of causal sdpa forward+backward at one sample's shape: enable_gqa, repeated KV, flash."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def make():
        q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
        return q, k, v

    def gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def repeated(q, k, v):
        n = heads // kv_heads
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1), is_causal=True
        )

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return repeated(q, k, v)

    results = {}
    for name, fn in (("enable_gqa", gqa), ("repeat_kv", repeated), ("flash_repeat_kv", flash)):
        times = []
        try:
            for i in range(repeats + 3):
                q, k, v = make()
                sync()
                t0 = time.perf_counter()
                fn(q, k, v).sum().backward()
                sync()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            results[name] = statistics.median(times)
        except RuntimeError as exc:  # a backend that refuses the shape or device says so, the others still run
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="Tiny model and steps (a smoke test, any device).")
    parser.add_argument("--rows", type=int, default=30, help="Rows of each profile table.")
    parser.add_argument("--out", default=None, help="Folder for learner_gpu_profile.txt (default: print only).")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from app.learner.rank import LearnerRank

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.small and device != "cuda":
        print("no CUDA device: skipped")
        return
    shape, step = (SMALL_MODEL, SMALL_STEP) if args.small else (QWEN25_1_5B, SEED_STEP)
    dtype = "bfloat16" if device == "cuda" else "float32"
    small = {"token_budget": SMALL_TOKEN_BUDGET, "logprob_chunk_tokens": 64}
    cfg = bench_config(device=device, **(small if args.small else {}))
    cfg.model.dtype = dtype
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    probe_tokens = 64 if args.small else 1000
    probe = attention_probe(
        device,
        getattr(torch, dtype),
        probe_tokens,
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        head_dim,
        repeats=5 if args.small else 20,
    )
    probe_text = f"sdpa fwd+bwd, one sample of {probe_tokens} tokens (median seconds): {probe}"
    print(probe_text, flush=True)
    with tempfile.TemporaryDirectory(prefix="spotrl-bench-learner-profile-") as workdir:
        model_path = build_model(Path(workdir) / "model", shape, device, getattr(torch, dtype))
        learner = LearnerRank(cfg, model_path)
        try:
            learner.setup()
            learner.prepare_training()
            text = profile_step(learner, step, shape["vocab_size"], args.rows)
        finally:
            learner.close()
    text = f"{probe_text}\n\n{text}\n"
    print(text)
    if args.out:
        path = Path(args.out) / "learner_gpu_profile.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
