"""A fleet on this one machine, for the integration tests and the router benchmark.

Both need the same things: Ray on loopback only (nothing else may be reached or exposed), a free
port for the HTTP ingress, and adapters to serve. Real adapters come from the learner; here a PEFT
LoRA on the base model with random `lora_B` (PEFT initialises it to zero, which would change
nothing) stands in, so that each version visibly changes the model's outputs.
"""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray(num_cpus: int = 2, metrics_export_port: int | None = None) -> None:
    """Start a fresh single-node Ray bound to 127.0.0.1 (metrics exported every second when a port is given)."""
    import ray

    kwargs = {}
    if metrics_export_port is not None:
        kwargs = {"_metrics_export_port": metrics_export_port, "_system_config": {"metrics_report_interval_ms": 1000}}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
        **kwargs,
    )


def random_adapter(model_path: str, folder: str | Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """Save a PEFT LoRA (all linear layers) with random `lora_A` and `lora_B`, so the adapter changes the outputs.

    Both come from `seed` alone (PEFT would draw `lora_A` from the global RNG): a seed is one adapter, always."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:  # PEFT's kaiming-uniform scale, ~1/sqrt(fan_in)
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(folder))
    return Path(folder)


def publish_random_adapters(store, model_path: str, versions: list[int], work_dir: str | Path, rank: int = 8) -> None:
    """Publish `policy-v{N}` for each version (a distinct random adapter each) to the bucket."""
    for version in versions:
        folder = random_adapter(model_path, Path(work_dir) / f"adapter-v{version}", seed=version, rank=rank)
        store.publish(folder, version)
