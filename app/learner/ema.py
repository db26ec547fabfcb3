"""The average an `ema` self teacher scores with: rank 0 keeps an exponential moving average of the LoRA weights.

A live self teacher (the run's newest version) moves with the student, so the student chases its own shadow: on the
tiny model it collapsed within 20 steps (docs/distillation.md). An average of the versions moves slower, as TRL's
SDFT and SDPO trainers keep theirs (`teacher_model_kind="ema"`, `PEFTAdapterEMACallback`): a second adapter of the
same LoRA shape, zero at first (the base model, what `base` scores with), and every `sync_steps` optimizer steps
`shadow = (1 - update_rate) * shadow + update_rate * student`, per tensor (the A and B matrices each, not their
product). The learner publishes it as the run's `ema` lineage beside its policy (`contracts.adapters.EMA_STEM`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from app.learner.state import write_adapter
from app.weight_sync import AdapterPublisher

log = logging.getLogger(__name__)

EMA_FILE = "ema.safetensors"  # in a checkpoint of a run with an ema teacher: the average, as the learner keeps it


class AdapterEma:
    """An exponential moving average of adapter tensors (PEFT state-dict keys to tensors), kept in float32."""

    def __init__(self, update_rate: float, sync_steps: int, like: dict[str, torch.Tensor]):
        if not 0 < update_rate <= 1 or sync_steps < 1:
            raise ValueError(f"update_rate must be in (0, 1] and sync_steps >= 1, not {update_rate}, {sync_steps}")
        self.update_rate, self.sync_steps = update_rate, sync_steps
        # Zero at first, as TRL's: the average starts at the base model and the student's share grows from there.
        self.shadow = {key: torch.zeros_like(value, dtype=torch.float32, device="cpu") for key, value in like.items()}

    def step(self, step: int, student: dict[str, torch.Tensor]) -> bool:
        """After optimizer step `step` (1-based): fold `student` into the average when `step` is a multiple of
        `sync_steps`; whether it did."""
        if step % self.sync_steps != 0:
            return False
        if student.keys() != self.shadow.keys():
            raise ValueError(
                f"adapter tensors differ from the average's: {sorted(student.keys() ^ self.shadow.keys())}"
            )
        with torch.no_grad():
            for key, value in student.items():
                self.shadow[key].lerp_(value.detach().to("cpu", torch.float32), self.update_rate)
        return True

    def state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The average's tensors (copies), in `dtype` (the adapter's, for publishing) or float32."""
        return {key: value.to(dtype or torch.float32, copy=True) for key, value in self.shadow.items()}

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Continue from a published average (a resumed learner's newest `ema` version)."""
        if tensors.keys() != self.shadow.keys():
            raise ValueError(
                f"adapter tensors differ from the average's: {sorted(tensors.keys() ^ self.shadow.keys())}"
            )
        self.shadow = {key: value.detach().to("cpu", torch.float32).clone() for key, value in tensors.items()}


class EmaLineage:
    """Rank 0's ema teacher: the average, published as `ema-vN` beside each `policy-vN` and kept in the learner's
    checkpoints (`EMA_FILE`), so that a resumed learner continues it rather than starting again from the base."""

    def __init__(self, average: AdapterEma, publisher: AdapterPublisher):
        self.average, self.publisher = average, publisher

    def publish(self, model, dtype: torch.dtype, version: int, tmp: Path) -> None:
        """Publish the average as `ema-v{version}` in the adapter's `dtype`, under the policy's number: a group
        sampled from policy-vN is scored with ema-vN, committed before the driver tells the rollout of the policy."""
        with tempfile.TemporaryDirectory(dir=tmp) as d:
            write_adapter(model, self.average.state(dtype), Path(d))
            published = self.publisher.publish(Path(d), version)
        if published != version:  # ema-vN taken in the run's prefix by another writer: moved past it
            log.warning(
                "ema-v%d is not this run's (planted): the average went to ema-v%d, and the ema teacher finds none "
                "for policy-v%d until the next version",
                version,
                published,
                version,
            )

    def save(self, checkpoint: Path) -> None:
        """Into a checkpoint's folder, before it is committed."""
        from safetensors.torch import save_file

        save_file(self.average.state(), checkpoint / EMA_FILE)

    def restore(self, checkpoint: Path, step: int) -> None:
        """A resumed learner's average, from its checkpoint of `step`; a checkpoint without one (the run had no ema
        teacher then) leaves it at the base model, where a fresh one starts."""
        if not (checkpoint / EMA_FILE).is_file():
            log.warning(
                "checkpoint step %d holds no ema average: the ema teacher starts again from the base model", step
            )
            return
        from safetensors.torch import load_file

        self.average.restore(load_file(checkpoint / EMA_FILE))

    def close(self) -> None:
        self.publisher.close()
