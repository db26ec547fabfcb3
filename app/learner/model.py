"""Building a learner rank's model: process group, base model + PEFT LoRA, FSDP2 sharding, AdamW.

Kept apart from the training loop (`app.learner.rank`) because its order matters and is easy to get
wrong: the adapter is initialised with the same seed on every rank (FSDP assumes identical
replicas), a checkpoint's adapter is loaded *before* sharding (plain tensors, no DTensor plumbing),
and the optimizer is built *after* sharding (it must hold the sharded parameters).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from app.config import RunConfig
from app.learner.packing import register_packed_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device_type: str) -> None:
    """Join the learner's process group: gloo on the CPU, NCCL between GPUs (of one learner node)."""
    if dist.is_initialized():
        return
    if master_addr.startswith("127.") and device_type == "cpu":
        # gloo otherwise binds the interface its hostname resolves to, which may be a public one.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface() or "lo")
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def build_lora_model(cfg: RunConfig, model_path: str, device: torch.device):
    """The base model with a fresh PEFT LoRA adapter (unsharded), and the pad token id; attention is
    `app.learner.packing`'s per-sample sdpa, so packed rows need no mask."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=DTYPES[cfg.model.dtype], attn_implementation=register_packed_attention()
    )
    base.config.use_cache = False
    if cfg.learner.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Every rank must draw the same LoRA init (FSDP shards assume identical replicas): seed it.
    torch.manual_seed(cfg.grpo.seed)
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    pad_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    return model.to(device), pad_id


def fully_shard_model(model, world_size: int, device_type: str) -> None:
    """FSDP2: each decoder block its own unit (only one block is gathered whole at a time), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    block_names = set(getattr(model.base_model.model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_optimizer(cfg: RunConfig, model):
    """AdamW over the trainable (LoRA) parameters, and the learning-rate schedule."""
    from transformers import get_scheduler

    g = cfg.grpo
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=g.learning_rate, betas=(g.adam_beta1, g.adam_beta2), weight_decay=g.weight_decay
    )
    # transformers' "constant" ignores warm-up; "constant_with_warmup" honours it.
    name = "constant_with_warmup" if g.lr_scheduler_type == "constant" and g.warmup_steps else g.lr_scheduler_type
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=g.warmup_steps, num_training_steps=g.max_steps)
    return optimizer, scheduler
