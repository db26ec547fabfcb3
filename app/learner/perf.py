"""FLOP counting and MFU for the learner, with TRL's conventions so the numbers compare with the seed's.

`flops_per_token` mirrors `trl.trainer.utils.compute_flops_per_token` for dense models (training =
3 x forward, the attention-score term counted non-causally over the mean sequence length, the
embedding a free lookup, the LM head a full matmul). It is restated here rather than imported
because importing `trl.trainer.utils` pulls in accelerate and datasets and costs seconds in every
learner process. With LoRA the frozen weights get no weight gradient, so the true backward is
cheaper than 2 x forward; like TRL we keep the 6N convention, so MFU is comparable, not exact.
MFU is a percentage, as TRL reports it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


def flops_per_token(config, seq_len: float) -> float:
    """Training FLOPs per token of a dense causal LM (forward + backward), at a mean sequence length."""
    h = config.hidden_size
    n_heads = config.num_attention_heads
    n_kv = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // n_heads
    attn = 2 * h * (n_heads * head_dim + 2 * n_kv * head_dim) + 2 * n_heads * head_dim * h
    attn += 2 * 2 * n_heads * head_dim * seq_len
    mlp = 2 * 3 * h * config.intermediate_size
    forward = config.num_hidden_layers * (attn + mlp) + 2 * config.vocab_size * h
    return 3.0 * forward


def mfu_percent(flops: float, seconds: float, world_size: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation, in percent of the devices' peak."""
    if seconds <= 0 or peak_flops_per_device <= 0:
        return 0.0
    return 100.0 * flops / seconds / (peak_flops_per_device * world_size)


class Stopwatch:
    """Named wall-clock accumulators for the phases of one step (`with watch("fwd_bwd"): ...`).

    `sync` (e.g. `torch.cuda.synchronize`) runs at both ends of a phase: GPU work is asynchronous,
    and without it the time lands in whichever later phase first waits for the device.
    """

    def __init__(self, sync=None):
        self.totals: dict[str, float] = {}
        self._sync = sync or (lambda: None)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def get(self, name: str) -> float:
        return self.totals.get(name, 0.0)


def step_perf_metrics(model_config, metrics: dict, step_s: float, world_size: int, peak_flops: float) -> dict:
    """The `perf/*` throughput metrics of one step, from its `batch/*` counts and `perf/fwd_bwd_s`.

    FLOPs count the real (non-pad) tokens forwarded: pad tokens are wasted work, so packing's gain shows.
    """
    fwd_bwd_s = max(metrics["perf/fwd_bwd_s"], 1e-9)
    real_tokens = metrics["batch/real_tokens"]
    trained = metrics["batch/trained_tokens"]
    flops = flops_per_token(model_config, real_tokens / max(metrics["batch/samples"], 1.0)) * real_tokens
    return {
        "perf/step_s": step_s,
        "perf/mfu_fwd_bwd": mfu_percent(flops, fwd_bwd_s, world_size, peak_flops),
        "perf/trained_tok_s": trained / step_s,
        "perf/trained_tok_s_fwd_bwd": trained / fwd_bwd_s,
        "perf/forwarded_tok_s_fwd_bwd": metrics["batch/forwarded_tokens"] / fwd_bwd_s,
    }
