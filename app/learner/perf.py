"""FLOP counting and MFU for the learner, with TRL's conventions so the numbers compare with the seed's.

`flops_per_token` mirrors `trl.trainer.utils.compute_flops_per_token` for dense models (training =
3 x forward, the attention-score term counted non-causally over the mean sequence length, the
embedding a free lookup, the LM head a full matmul). It is restated here rather than imported
because importing `trl.trainer.utils` pulls in accelerate and datasets and costs seconds in every
learner process. With LoRA the frozen weights get no weight gradient, so the true backward is
cheaper than 2 x forward; like TRL we keep the 6N convention, so MFU is comparable, not exact.
MFU is a percentage, as TRL reports it.

The peak it divides by is looked up by device name (`PEAK_FLOPS_BY_NAME`): spec-sheet numbers, which
no real kernel reaches (an H200 measures ~790 TFLOP/s on a large dense bf16 matmul against its 989),
so MFU is quoted against the spec peak, the convention that makes it comparable across papers.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from contextlib import contextmanager

# Dense (no sparsity) BF16/FP16 tensor-core peak FLOP/s of one GPU, from NVIDIA's spec sheets, by the name
# `torch.cuda.get_device_name()` reports (a case-insensitive regex; the first match wins, so variants come
# before their family). Spec sheets headline the 2:4-sparsity figure: these are half of it.
PEAK_FLOPS_BY_NAME: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bNVL\b", 835e12),  # H100 NVL (1,671 sparse)
    (r"\bH100\b.*\bPCIe\b", 756e12),  # H100 PCIe (1,513 sparse)
    (r"\bH100\b", 989e12),  # H100 SXM, reported as "NVIDIA H100 80GB HBM3" (1,979 sparse)
    (r"\bH200\b.*\bNVL\b", 835e12),  # H200 NVL (1,671 sparse)
    (r"\bH200\b", 989e12),  # H200 SXM (1,979 sparse)
    (r"\bGH200\b", 989e12),  # Grace Hopper: the H100/H200 SXM die and clocks
    (r"\bGB200\b", 2.5e15),  # GB200 NVL72, per GPU (5 PFLOP/s sparse)
    (r"\bB200\b", 2.25e15),  # HGX B200, per GPU (4.5 PFLOP/s sparse)
    (r"\bA100\b", 312e12),  # A100 SXM and PCIe, 40 and 80 GB (624 sparse)
    (r"\bA10G?\b", 125e12),  # A10 (250 sparse); AWS's A10G has no sheet of its own, quoted as the A10
    (r"\bL40S\b", 362e12),  # L40S (733 sparse)
    (r"\bL40\b", 181e12),  # L40 (362 sparse)
    (r"\bL4\b", 121e12),  # L4 (242 sparse)
)


def peak_flops(device_name: str, device_type: str, overrides: Mapping[str, float] | None = None) -> float:
    """Peak FLOP/s of one learner device, for MFU; NaN when unknown (MFU is then NaN, never a guess).

    `overrides` (the config's `learner.peak_flops`) win: by exact device name first (case-insensitive),
    then by device kind ("cpu", "cuda": one figure for every device of that kind); else the spec table.
    """
    by_key = {k.lower(): v for k, v in (overrides or {}).items()}
    for key in (device_name.lower(), device_type.lower()):
        if key in by_key:
            return float(by_key[key])
    if device_type == "cuda":
        for pattern, flops in PEAK_FLOPS_BY_NAME:
            if re.search(pattern, device_name, re.IGNORECASE):
                return flops
    return math.nan


def device_name(device) -> str:
    """What a device is called in logs, results and `peak_flops`: the GPU's model name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


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
