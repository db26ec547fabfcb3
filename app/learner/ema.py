"""The average an `ema` self teacher scores with: rank 0 keeps an exponential moving average of the LoRA weights.

A live self teacher (the run's newest version) moves with the student, so the student chases its own shadow: on the
tiny model it collapsed within 20 steps (docs/distillation.md). An average of the versions moves slower, as TRL's
SDFT and SDPO trainers keep theirs (`teacher_model_kind="ema"`, `PEFTAdapterEMACallback`): a second adapter of the
same LoRA shape, zero at first (the base model, what `base` scores with), and every `sync_steps` optimizer steps
`shadow = (1 - update_rate) * shadow + update_rate * student`, per tensor (the A and B matrices each, not their
product). The learner publishes it as the run's `ema` lineage beside its policy (`contracts.adapters.EMA_STEM`).
"""

from __future__ import annotations

import torch


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
