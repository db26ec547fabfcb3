"""Building a learner rank's model: process group, base model + PEFT LoRA, FSDP2 sharding, AdamW.

Kept apart from the training loop (`app.learner.rank`) because its order matters and is easy to get
wrong: the adapter is initialised with the same seed on every rank (FSDP assumes identical
replicas), a checkpoint's adapter is loaded *before* sharding (plain tensors, no DTensor plumbing),
and the optimizer is built *after* sharding (it must hold the sharded parameters).

Precision on a GPU (`model.dtype: bfloat16`): the frozen base weights stay bfloat16 (half the memory,
and they never see an optimizer), the trainable LoRA weights are fp32 masters with fp32 AdamW state,
and FSDP2's `MixedPrecisionPolicy` hands every layer bfloat16 copies for forward and backward and
reduces the gradients in fp32. FSDP2 only requires the *trainable* parameters of a unit to share one
dtype (frozen ones may differ, since torch 2.8), which is what lets a bf16 base carry fp32 adapters. Without the policy,
PEFT runs its LoRA layers in fp32 and keeps fp32 copies of their inputs for backward. So on CUDA the
learner always runs FSDP2, even on one GPU (a process group of one): a single-GPU learner computes
exactly like each rank of a multi-GPU one. On the CPU nothing changes: float32, and FSDP only with
several ranks (bfloat16 matmuls on the CPU are slow, and the tests compare fp32 results).

The output layer is wrapped in `app.learner.logprobs.LogProbHead` so that a forward can return the
log-probs of the sampled tokens instead of `[rows, positions, vocab]` logits.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from app.learner.logprobs import LogProbHead
from app.learner.packing import register_packed_attention
from app.learner.truncation import Truncation

if TYPE_CHECKING:  # not at run time: the GPU benchmark drives the learner without pydantic
    from app.objectives import LossStats
    from core.config import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def uses_fsdp(world_size: int, device_type: str) -> bool:
    """Whether the learner shards its model with FSDP2: always on CUDA (for its mixed precision, even on one
    GPU), on the CPU only with several ranks."""
    return world_size > 1 or device_type == "cuda"


def init_distributed(
    rank: int, world_size: int, master_addr: str | None, master_port: int | None, device_type: str
) -> None:
    """Join the learner's process group: gloo on the CPU, NCCL between GPUs (of one learner node).

    A group of one needs no rendezvous: it keeps its store in memory (no port, no address)."""
    if dist.is_initialized():
        return
    if device_type == "cpu" and (world_size == 1 or (master_addr or "").startswith("127.")):
        # gloo otherwise binds the interface its hostname resolves to, which may be a public one.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface() or "lo")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def rendezvous_address() -> tuple[str, int]:
    """An address of this node (as Ray knows it) and a free port on it: rank 0's, for the ranks' TCP rendezvous."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return ip, sock.getsockname()[1]


def peft_lora_config(lora):
    """peft's LoraConfig of the run's `lora` section: what the learner trains, and what a baseline given the same
    adapter builds (`bench.self_distill`)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def build_lora_model(cfg: RunConfig, model_path: str, device: torch.device):
    """The base model with a fresh PEFT LoRA adapter (unsharded), and the pad token id.

    Attention is `app.learner.packing`'s per-sample sdpa, so packed rows need no mask; the output layer
    is a `LogProbHead` (`logprob_head(model)`); the trainable parameters are fp32 whatever the base's dtype.
    """
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=DTYPES[cfg.model.dtype],
        attn_implementation=register_packed_attention(),
        revision=cfg.model.revision,
    )
    base.config.use_cache = False
    if cfg.learner.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Every rank must draw the same LoRA init (FSDP shards assume identical replicas): seed it.
    torch.manual_seed(cfg.train.seed)
    model = get_peft_model(base, peft_lora_config(cfg.lora))
    # fp32 masters: PEFT's autocast_adapter_dtype already makes half-precision adapters fp32; say so explicitly,
    # since FSDP2's mixed precision and the fp32 AdamW state rely on it.
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    # After get_peft_model: "all-linear" never targets the output layer, which must stay a plain frozen Linear.
    # With tied embeddings the wrapped Linear keeps the very weight object the input embedding uses.
    # The head takes log-probs under the sampler's truncation (top-k/top-p), over the tokens vLLM's are.
    head = LogProbHead(base.get_output_embeddings(), cfg.learner.logprob_chunk_tokens, Truncation.of(cfg.sampling))
    base.set_output_embeddings(head)
    pad_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    return model.to(device), pad_id


def logprob_head(model) -> LogProbHead:
    """The `LogProbHead` that `build_lora_model` put in place of the output layer."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogProbHead):
        raise TypeError(f"the model's output layer is a {type(head).__name__}, not a LogProbHead (build_lora_model)")
    return head


def mixed_precision_policy(dtype: str, device_type: str):
    """FSDP2's policy: compute in the model's half dtype, reduce gradients in fp32 — on CUDA only.

    None elsewhere (float32 models, and the CPU, whose parameters compute in their own dtype as before)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type != "cuda" or DTYPES[dtype] == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)


def fully_shard_model(model, world_size: int, device_type: str, mp_policy=None, ignored_params=None) -> None:
    """FSDP2: each decoder block its own unit (only one block is gathered whole at a time), then the root
    (embeddings, final norm, output layer); `mp_policy` as `mixed_precision_policy` gives it. `ignored_params` stay
    whole and unmanaged on every rank (the Tinker learner's adapters, whose gradients it reduces itself)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    options = {
        "mesh": mesh,
        **({"mp_policy": mp_policy} if mp_policy is not None else {}),
        **({"ignored_params": set(ignored_params)} if ignored_params else {}),
    }
    block_names = set(getattr(model.base_model.model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, **options)
    fully_shard(model, **options)


def build_optimizer(cfg: RunConfig, model):
    """AdamW over the trainable (LoRA) parameters, and the learning-rate schedule."""
    from transformers import get_scheduler

    g = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=g.learning_rate, betas=(g.adam_beta1, g.adam_beta2), weight_decay=g.weight_decay
    )
    # transformers' "constant" ignores warm-up; "constant_with_warmup" honours it.
    name = "constant_with_warmup" if g.lr_scheduler_type == "constant" and g.warmup_steps else g.lr_scheduler_type
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=g.warmup_steps, num_training_steps=g.max_steps)
    return optimizer, scheduler


def reduce_over_ranks(stats: LossStats, loss_sum: float, world_size: int, device) -> tuple[LossStats, float]:
    """Token statistics summed over ranks (min/max for extremes), and the loss: one small all-reduce each."""
    if world_size == 1:
        return stats, loss_sum
    sums, lo, hi = stats.as_tensors()
    sums = torch.cat([sums, torch.tensor([loss_sum], dtype=torch.float64)]).to(device)
    lo, hi = lo.to(device), hi.to(device)
    dist.all_reduce(sums)
    if lo.numel():
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    if hi.numel():
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    sums, lo, hi = sums.cpu(), lo.cpu(), hi.cpu()
    return stats.from_tensors(sums[:-1], lo, hi), sums[-1].item()
