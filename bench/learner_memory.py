"""Peak memory of the learner's log-prob + entropy + GRPO loss path: chunked vs the full `[tokens x vocab]` logits.

Qwen2.5's output layer (151,936 x 1,536, frozen as under LoRA) scores the completion
tokens of one micro-batch: hidden states in, GRPO loss out, then backward into the hidden states.
The hidden states and the layer are bfloat16 on CUDA, float32 on the CPU.
`unchunked` is the plain path (the lm_head's logits, `logprobs.token_logprobs`); `chunked` is
`app.learner.logprobs.chunked_token_logprobs`. Each variant runs in its own fresh process, so the
peak is its own: resident memory on the CPU (peak RSS above the process's baseline with the inputs
allocated), `torch.cuda.max_memory_allocated` on CUDA. The values of both paths are compared too.

    python -m bench.learner_memory [--tokens 2048] [--vocab 151936] [--hidden 1536] [--device cpu|cuda]

Writes bench/results/learner_memory.json with the unchunked/chunked peak ratio. The seed recipe's
micro-batch holds up to 16,384 tokens; on a 24 GiB CPU box the unchunked path cannot hold that many
(about 10 GB per fp32 copy of the logits), so the CPU default is 2,048 and CUDA's 16,384.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import resource
import time

from bench.common import fmt_bytes, print_table, write_result


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_variant(variant: str, tokens: int, vocab: int, hidden_size: int, device: str, chunk_tokens: int) -> dict:
    """One forward + backward of the path in this (fresh) process; its peak memory above the inputs'."""
    import torch

    from app.learner.logprobs import chunked_token_logprobs, token_logprobs
    from app.objectives.grpo import grpo_loss

    torch.manual_seed(0)
    # bfloat16 as the GPU learner runs it; float32 on the CPU, whose bfloat16 matmuls take minutes here
    # (the unchunked path's peak is its float32 copies of the logits either way).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = (torch.randn(tokens, hidden_size, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device) * 0.02).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    sampling_logp = torch.full((tokens,), -11.0, device=device)
    advantages = torch.randn(tokens, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    t0 = time.perf_counter()
    if variant == "chunked":
        logp, entropy = chunked_token_logprobs(hidden, weight, targets, 1.0, chunk_tokens=chunk_tokens)
    else:
        logp, entropy = token_logprobs(torch.nn.functional.linear(hidden, weight), targets, 1.0)
    loss, _ = grpo_loss(logp, sampling_logp, advantages, tokens, epsilon=0.2, epsilon_high=0.2, entropy=entropy)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss() - base
    return {
        "variant": variant,
        "peak_bytes": peak,
        "seconds": time.perf_counter() - t0,
        "logp": logp.detach().float().cpu()[:256].tolist(),
        "entropy": entropy.detach().float().cpu()[:256].tolist(),
        "grad_norm": hidden.grad.float().norm().item(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available).")
    parser.add_argument("--tokens", type=int, default=None, help="Completion tokens in the micro-batch.")
    parser.add_argument("--vocab", type=int, default=151_936, help="Vocabulary size (Qwen2.5's by default).")
    parser.add_argument("--hidden", type=int, default=1536, help="Hidden size (Qwen2.5-1.5B's by default).")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="Tokens per chunk of the chunked path.")
    parser.add_argument("--out", default=None, help="Results folder (default bench/results).")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or (16_384 if device == "cuda" else 2_048)
    spawn = multiprocessing.get_context("spawn")
    results = {}
    for variant in ("chunked", "unchunked"):  # a fresh process each: a peak is never a leftover of the other
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            job = (variant, tokens, args.vocab, args.hidden, device, args.chunk_tokens)
            results[variant] = pool.submit(run_variant, *job).result()
    chunked, plain = results["chunked"], results["unchunked"]
    max_logp_diff = max(abs(a - b) for a, b in zip(chunked["logp"], plain["logp"], strict=True))
    max_entropy_diff = max(abs(a - b) for a, b in zip(chunked["entropy"], plain["entropy"], strict=True))
    ratio = plain["peak_bytes"] / max(chunked["peak_bytes"], 1)
    print_table(
        ["path", "peak memory", "fwd+bwd s"],
        [[r["variant"], fmt_bytes(r["peak_bytes"]), f"{r['seconds']:.2f}"] for r in (chunked, plain)],
        title=f"log-prob + entropy + loss, {tokens} tokens x vocab {args.vocab} on {device}",
    )
    print(
        f"unchunked / chunked peak: {ratio:.1f}x; max |logp diff| {max_logp_diff:.2e}, entropy {max_entropy_diff:.2e}"
    )
    summary = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "memory_measure": "cuda max_memory_allocated" if device == "cuda" else "peak RSS above the inputs",
        "tokens": tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk_tokens": args.chunk_tokens,
        "peak_bytes": {"chunked": chunked["peak_bytes"], "unchunked": plain["peak_bytes"]},
        "seconds": {"chunked": chunked["seconds"], "unchunked": plain["seconds"]},
        "unchunked_over_chunked_peak": ratio,
        "max_abs_logp_diff": max_logp_diff,
        "max_abs_entropy_diff": max_entropy_diff,
        "grad_norm": {"chunked": chunked["grad_norm"], "unchunked": plain["grad_norm"]},
    }
    path = write_result("learner_memory", summary, results_dir=args.out and __import__("pathlib").Path(args.out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
