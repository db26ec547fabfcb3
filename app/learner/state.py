"""What a learner must write down to be resumed exactly: adapter, optimizer, scheduler, RNG, counters.

Checkpoints are world-size-agnostic: the adapter and the optimizer state are stored *full* (gathered
from every FSDP shard, keyed by parameter name) and re-sharded on load, so a run checkpointed on two
ranks resumes on one and vice versa. Only the LoRA parameters are trainable, so "full" is a few
megabytes even for the seed's 1.5B model; the frozen base weights are never gathered or stored.

Layout of one checkpoint folder (what `CheckpointStore.save` uploads):
    adapter/adapter_model.safetensors, adapter/adapter_config.json   the adapter, in PEFT format
    training_state.safetensors  every tensor of the optimizer (full AdamW state, keyed by parameter
                                name) and of the RNGs (torch, cuda) of every rank
    training_state.json         the rest as JSON: optimizer param groups, scheduler, python and numpy RNGs
    learner_state.json          step, policy version, data cursor, consumed groups (frontier + the few ids
                                above it: `contracts.rollouts.ConsumedGroups`), world size

No pickle anywhere: anyone who can write the bucket could otherwise run code on the learner through
`torch.load`. A checkpoint of the older pickled layout (`optimizer.pt`) is refused with a clear message.

Consumed group ids are ints; checkpoints written when they were "g{index}" strings are converted on read, and so are
those that listed every id ever trained (before the frontier was kept): their data cursor is the frontier.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from app.messages import ResumePoint
from contracts.rollouts import ConsumedGroups

ADAPTER_DIR = "adapter"
STATE_FILE = "learner_state.json"
TENSORS_FILE = "training_state.safetensors"
TRAINING_FILE = "training_state.json"
_TENSOR, _NDARRAY, _TUPLE = "__tensor__", "__ndarray__", "__tuple__"


@dataclass
class LearnerState:
    """The learner's counters; `policy_version` is the last version it published (None before any)."""

    step: int = 0
    policy_version: int | None = None
    data_cursor: int | None = None
    consumed_group_ids: list[int] = field(default_factory=list)  # trained ids at or above the frontier (a few)
    consumed_frontier: int = 0  # every group id below it is settled (`contracts.rollouts.ConsumedGroups`)

    def consumed(self) -> ConsumedGroups:
        return ConsumedGroups.of(self.consumed_group_ids, self.consumed_frontier)

    def set_consumed(self, consumed: ConsumedGroups) -> None:
        self.consumed_frontier, self.consumed_group_ids = consumed.frontier, consumed.ids()

    def resume_point(self) -> ResumePoint:
        """The counters as the message the driver and the rollout receive (after `start`, a version exists)."""
        return ResumePoint(
            step=self.step,
            policy_version=self.policy_version if self.policy_version is not None else 0,
            data_cursor=self.data_cursor,
            consumed_group_ids=tuple(self.consumed_group_ids),
            consumed_frontier=self.consumed_frontier,
        )


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable (LoRA) parameter, whole, on the CPU, keyed by its name in `model`.

    Under FSDP each rank holds a shard of every parameter (a DTensor); `full_tensor()` all-gathers it,
    so every rank must call this, in the same order, even though only rank 0 writes the result.
    """
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = t.detach().to("cpu", copy=True)
    return out


def write_adapter(peft_model, adapter_state: dict[str, torch.Tensor], dest: Path) -> Path:
    """Save a full adapter state as a PEFT folder (adapter_model.safetensors + adapter_config.json)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(peft_model, state_dict=adapter_state, save_embedding_layers=False)
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, dest / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(dest))
    return dest


def load_adapter_weights(peft_model, adapter_dir: Path) -> None:
    """Load a PEFT folder's weights into an (unsharded) PEFT model, refusing any missing LoRA tensor."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(peft_model, load_file(Path(adapter_dir) / "adapter_model.safetensors"))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise RuntimeError(f"adapter at {adapter_dir} lacks {len(missing)} LoRA tensors, e.g. {missing[0]}")


def split_tensors(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """`obj` as JSON, each tensor replaced by a reference to its entry in `tensors` (arrays and tuples kept)."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()
        return {_TENSOR: path}
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if not all(isinstance(k, str | int) for k in obj):
            raise TypeError(f"{path or 'state'}: keys must be str or int to be stored as JSON")
        # JSON object keys are strings: int keys (optimizer state by index) are tagged to come back as ints.
        return {"__dict__": [[k, split_tensors(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [split_tensors(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_tensors(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"{path or 'state'}: {type(obj).__name__} cannot be stored without pickle")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of `split_tensors`."""
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _NDARRAY in obj:
        return np.asarray(obj[_NDARRAY], dtype=obj["dtype"])
    if _TUPLE in obj:
        return tuple(join_tensors(v, tensors) for v in obj[_TUPLE])
    return {k: join_tensors(v, tensors) for k, v in obj["__dict__"]}


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(world_size: int) -> list[dict]:
    """Every rank's RNG state, in rank order (a collective when world_size > 1)."""
    mine = _rng_state()
    if world_size == 1:
        return [mine]
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, mine)
    return states


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer state with whole tensors, keyed by parameter name (a collective under FSDP)."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_checkpoint(
    dest: Path,
    *,
    peft_model,
    adapter_state,
    optimizer_state,
    scheduler,
    rng_states,
    state: LearnerState,
    world_size: int,
) -> Path:
    """Write one checkpoint folder (rank 0 only; the inputs were gathered by every rank)."""
    from safetensors.torch import save_file

    dest = Path(dest)
    write_adapter(peft_model, adapter_state, dest / ADAPTER_DIR)
    tensors: dict[str, torch.Tensor] = {}
    rest = split_tensors(
        {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": rng_states}, tensors
    )
    save_file(tensors, dest / TENSORS_FILE)
    (dest / TRAINING_FILE).write_text(json.dumps(rest))
    write_state(dest, state, world_size)
    return dest


def write_state(folder: Path, state: LearnerState, world_size: int) -> None:
    """The counters of a checkpoint (`STATE_FILE`), as `read_state` reads them back."""
    (Path(folder) / STATE_FILE).write_text(json.dumps({**asdict(state), "world_size": world_size}))


def read_training_state(folder: Path) -> dict:
    """Optimizer, scheduler and RNG states of a checkpoint folder, read without unpickling anything."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / TRAINING_FILE).is_file():
        if (folder / "optimizer.pt").is_file():
            raise RuntimeError(
                f"checkpoint {folder} is in the old pickled layout (optimizer.pt), which spotrl no longer loads: "
                "unpickling runs code that anyone with write access to the bucket could have put there. "
                "Start the run afresh (a new bucket.url or run name), or resume from a newer checkpoint."
            )
        raise RuntimeError(f"checkpoint {folder}: {TRAINING_FILE} is missing")
    return join_tensors(json.loads((folder / TRAINING_FILE).read_text()), load_file(folder / TENSORS_FILE))


def read_state(folder: Path) -> LearnerState:
    data = json.loads((Path(folder) / STATE_FILE).read_text())
    data.pop("world_size", None)
    # A checkpoint from before the frontier was kept lists every id trained; its data cursor is the frontier.
    frontier = data.pop("consumed_frontier", None)
    frontier = frontier if frontier is not None else data.get("data_cursor") or 0
    state = LearnerState(**{**data, "consumed_group_ids": []})
    state.set_consumed(ConsumedGroups.of(data.get("consumed_group_ids", ()), frontier))
    return state


def restore_training_state(folder: Path, *, model, optimizer, scheduler, rank: int) -> None:
    """Load optimizer, scheduler and this rank's RNG from a checkpoint folder (adapter loaded before sharding).

    Every rank reads the full optimizer state and keeps its own shard of it. A rank that did not
    exist when the checkpoint was written (the world grew) takes rank 0's RNG state.
    """
    saved = read_training_state(folder)
    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=saved["optimizer"], options=StateDictOptions(full_state_dict=True)
    )
    scheduler.load_state_dict(saved["scheduler"])
    rng_states = saved["rng"]
    _set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
