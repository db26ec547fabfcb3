"""Objectives: what the learner optimises, as a layer between the rollout and the learner.

An objective annotates a group on the rollout side (per-token streams: GRPO's advantages, a
teacher's log-probs) and gives the learner a loss over those streams, so that packing lays out streams
without knowing what they mean and the learner sums losses without knowing which algorithm they are.

- `app.objectives.base`: the `Objective` interface and the `LossStats` every loss reports;
- `app.objectives.grpo`: GRPO, with TRL's AsyncGRPO semantics (the run's default);
- `app.objectives.distill`: on-policy distillation, the reverse KL to a teacher per sampled token (Tinker's), or a
  divergence over the teacher's top k (TRL's `topk_logits`);
- `app.objectives.tinker_losses`: the Tinker SDK's built-in losses (`cross_entropy`, `importance_sampling`, `ppo`, ...);
- `app.objectives.combined`: `Objectives`, the run's objectives as `RunConfig.objectives` lists them.
"""

from app.objectives.base import LossStats, Objective
from app.objectives.combined import KINDS, Objectives

__all__ = ["KINDS", "LossStats", "Objective", "Objectives"]
