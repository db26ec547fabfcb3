"""What a learner rank makes of samples without training on them: the log-prob of every trained token.

Tests compare these with the sampler's (vLLM's) log-probs and the GPU paths with the plain ones; the evaluation of a
learner can use them alike. They go through the training path (same batching, same forward), without gradients.
"""

from __future__ import annotations

from typing import Protocol

import torch

from app.learner.packing import MicroBatch, samples_from_groups
from contracts.rollouts import Group


class Scoring(Protocol):
    """What scoring needs of a learner rank (`app.learner.rank.LearnerRank`): its model and device, its batching of
    groups (`plan`) and its forward."""

    model: torch.nn.Module
    device: torch.device

    def plan(self, groups: list[Group]) -> tuple[list[MicroBatch], dict]: ...

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


@torch.no_grad()
def score_groups(rank: Scoring, groups: list[Group]) -> list[list[list[float]]]:
    """`rank`'s log-prob of every trained token (every completion token of a single-turn sample, every model token of
    an episode), at the sampling temperature, per group and sample.

    Each rank forwards everything, so under FSDP every rank must call it, and each returns the full answer.
    """
    samples = samples_from_groups(groups)  # in the order `plan` lays them out
    batches, _ = rank.plan(groups)
    out: list[list[list[float]]] = [[[] for _ in grp.samples] for grp in groups]
    was_training = rank.model.training
    rank.model.eval()
    try:
        for mb in batches:
            logp, _ = rank._forward(mb.to(rank.device))  # the rank's forward (a test may swap it for another)
            # Targets of one sample are laid out in order, so appending keeps each sample's tokens in order.
            for index, value in zip(mb.target_sample.tolist(), logp.cpu().tolist(), strict=True):
                gi, si = samples[index].origin
                out[gi][si].append(value)
    finally:
        rank.model.train(was_training)
    return out
