"""Overlong shaping (DAPO): a soft penalty for completions near the length limit, and truncated samples masked.

A completion cut by `sampling.max_completion_length` scored as wrong teaches "shorter" as much as "wrong"; DAPO
instead penalises linearly over the last `overlong_buffer` tokens before the limit, and can leave a truncated sample
out of the group's comparison altogether (a NaN reward: advantage 0, outside the group's mean and std).
Single-turn samples only: a multi-turn episode's limit is per turn, so its length says nothing about one turn's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contracts.rollouts import Group


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft penalty: 0 up to `max_length - buffer` tokens, then falling linearly to `-factor` at the limit."""
    if buffer <= 0 or length <= max_length - buffer:
        return 0.0
    return -factor * min(1.0, (length - (max_length - buffer)) / buffer)


@dataclass
class OverlongShaping:
    """The rollout's overlong settings, applied to each scored group before it is judged or annotated."""

    max_length: int
    buffer: int = 0  # tokens before the limit over which the penalty grows; 0: no penalty
    factor: float = 1.0  # the penalty at the limit
    mask_truncated: bool = False

    @classmethod
    def from_config(cls, cfg) -> OverlongShaping:
        r = cfg.rollout
        return cls(cfg.sampling.max_completion_length, r.overlong_buffer, r.overlong_penalty, r.mask_truncated)

    @property
    def active(self) -> bool:
        return self.buffer > 0 or self.mask_truncated

    def apply(self, group: Group) -> tuple[int, int]:
        """Shape the group's rewards in place; returns (samples penalised, truncated samples masked)."""
        penalised = masked = 0
        for s in group.samples:
            if s.completion_mask is not None or math.isnan(s.reward):
                continue
            if self.mask_truncated and s.truncated:
                s.reward = math.nan
                masked += 1
                continue
            penalty = overlong_penalty(len(s.completion_ids), self.max_length, self.buffer, self.factor)
            if penalty:
                s.reward += penalty
                penalised += 1
        return penalised, masked
