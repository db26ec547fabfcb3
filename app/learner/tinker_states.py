"""A Tinker training client's adapter and optimizer, and their forms in the fleet's bucket.

A sampler version is a PEFT folder committed to the tenant's prefix of the fleet's bucket (`core.bucket.AdapterStore`,
signed with the lineage's key), exactly what `app.weight_sync` publishes for a run; a saved state is the adapter, its
optimizer and its spec through `core.bucket.CheckpointStore` (with a gradient not yet applied when the service keeps a
client mid-step on a spot notice); an export (`save_weights_external`) the adapter alone in PEFT's format, for the
user to download. Each is committed under a number of its store never used before (`core.bucket.tinker_paths`); the
tinker path the user is given for it is the service's to record.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from contracts.auth import Secret
from contracts.tinker import AdapterSpec, Export, Lineage, Publication
from core.bucket import tinker_paths

OPTIMIZER_FILE = "optimizer.pt"
GRADIENT_FILE = "gradient.pt"  # a state the service kept mid-step: the adapter's gradient, in its optimizer's order
SPEC_FILE = "tinker_spec.json"
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class Client:
    """One training client's adapter: its PEFT name, what it was created with, its optimizer."""

    adapter: str
    spec: AdapterSpec
    optimizer: torch.optim.AdamW
    steps: int = 0


def params(client: Client) -> list[torch.Tensor]:
    """The client's adapter weights in its optimizer's order: the same order for every adapter of one spec."""
    return [p for group in client.optimizer.param_groups for p in group["params"]]


def write_adapter(peft, client: Client, model_path: str, dest: Path) -> Path:
    """The client's adapter as a PEFT folder at `dest` (what `PeftModel.from_pretrained` and vLLM load)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(peft, adapter_name=client.adapter, save_embedding_layers=False)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, dest / ADAPTER_FILE)
    config = peft.peft_config[client.adapter]
    config.base_model_name_or_path = model_path
    config.save_pretrained(str(dest))
    return dest


def commit_version(lineage: Lineage, folder: Path) -> Publication:
    """Commit a PEFT folder as the tenant's next `policy-vN`, signed with its lineage's key."""
    store = tinker_paths.store(lineage.bucket_url, "sampler", lineage.cache_dir, Secret(lineage.signing_key))
    version = tinker_paths.commit_new(lineage.bucket_url, "sampler", store.latest, lambda n: store.publish(folder, n))
    return Publication(version, store.key_of(version))


def publish(peft, client: Client, model_path: str, lineage: Lineage) -> Publication:
    with tempfile.TemporaryDirectory(prefix="tinker-adapter-") as tmp:
        return commit_version(lineage, write_adapter(peft, client, model_path, Path(tmp) / "adapter"))


def adopt(lineage: Lineage, source: str, version: int, source_key: str) -> Publication:
    """Copy sampler version `version` of the prefix `source` into the tenant's lineage, signed anew with its key; the
    original must verify under its owner's key (`source_key`) first (`NotSigned` otherwise)."""
    owners = tinker_paths.store(source, "sampler", lineage.cache_dir, Secret(source_key))
    with tempfile.TemporaryDirectory(prefix="tinker-adopt-") as tmp:
        return commit_version(lineage, owners.fetch(version, Path(tmp) / "adapter"))


def save_state(peft, client: Client, model: str, model_path: str, lineage: Lineage, gradient: bool) -> int:
    """Commit the client's adapter, optimizer and spec (and with `gradient`, what it accumulated and no step applied)
    as the tenant's next state; its number."""
    states = tinker_paths.store(lineage.bucket_url, "training", lineage.cache_dir)
    with tempfile.TemporaryDirectory(prefix="tinker-state-") as tmp:
        folder = write_adapter(peft, client, model_path, Path(tmp) / "state")
        torch.save(client.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        grads = [p.grad for p in params(client)]
        if gradient and any(g is not None for g in grads):
            torch.save(grads, folder / GRADIENT_FILE)
        spec = client.spec
        saved = {"rank": spec.rank, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp, "steps": client.steps}
        (folder / SPEC_FILE).write_text(json.dumps(saved))
        meta = {"model": model, "steps": client.steps}
        return tinker_paths.commit_new(
            lineage.bucket_url, "training", states.latest, lambda n: states.save(n, folder, meta=meta)
        )


def export(peft, client: Client, model: str, model_path: str, lineage: Lineage) -> Export:
    """Commit the client's adapter as a PEFT folder to the tenant's exports, for download."""
    exports = tinker_paths.store(lineage.bucket_url, "external", lineage.cache_dir)
    with tempfile.TemporaryDirectory(prefix="tinker-export-") as tmp:
        folder = write_adapter(peft, client, model_path, Path(tmp) / "export")
        files = {f.name: f.stat().st_size for f in folder.iterdir()}
        number = tinker_paths.commit_new(
            lineage.bucket_url, "external", exports.latest, lambda n: exports.save(n, folder, meta={"model": model})
        )
    return Export(number, files)


def fetch_state(lineage: Lineage, number: int, source: str | None, dest: Path) -> tuple[AdapterSpec, int, Path]:
    """State `number` of the tenant's states (of the prefix `source`, when another tenant's) in folder `dest`: the
    adapter's spec, its steps, the folder."""
    states = tinker_paths.store(source or lineage.bucket_url, "training", lineage.cache_dir)
    folder = states.load(number, dest)
    saved = json.loads((folder / SPEC_FILE).read_text())
    return AdapterSpec(saved["rank"], None, saved["train_attn"], saved["train_mlp"]), int(saved.get("steps", 0)), folder


def restore(peft, client: Client, folder: Path, optimizer: bool, steps: int, device: torch.device) -> None:
    """Set a fresh client's adapter (and with `optimizer`, its moments and steps) from a fetched state; a gradient
    saved with it (a notice's save between forward_backward and optim_step) is set too."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(peft, load_file(folder / ADAPTER_FILE, device=str(device)), adapter_name=client.adapter)
    if optimizer:
        client.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=device))
        client.steps = steps
    if (folder / GRADIENT_FILE).exists():
        grads = torch.load(folder / GRADIENT_FILE, weights_only=True, map_location=device)
        for p, grad in zip(params(client), grads, strict=True):
            p.grad = grad
