"""What an objective is: one term of the learner's loss, and what the rollout attaches to a group for it.

An objective works on both sides of a run. On the rollout side, `annotate` writes the per-token
streams its loss needs into every sample of a group (GRPO: the group-normalised advantage), before the
group is queued, so the learner receives groups ready to train. On the learner side, `loss` takes the
learner's log-probs of the trained tokens of one micro-batch and the streams at those tokens (the
sampler's log-probs always among them) and answers its share of the step's loss, divided by the
objective's own token count over the whole step (`num_tokens`), and its `LossStats`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from contracts.rollouts import SAMPLING_LOGPROBS, Group

# The stream an objective's loss finds the learner's log-probs in (with gradient, `[targets, k]`) at the ids it asked
# for (`Objective.scored_ids`): no rollout writes it, the learner adds it to the micro-batch's streams.
LEARNER_LOGPROBS_AT_IDS = "learner_logprobs_at_ids"
# The stream each trained token's sample index is in (within its micro-batch): no rollout writes it, the learner's
# packing adds it (`app.learner.packing`), for a loss that works per sample (GRPO's sequence-level guard).
SAMPLE_INDEX = "sample_index"
SQUARES = "/sq_mean"  # a sum named `<m>/sq_mean`, of the squares of what `<m>` sums, also yields `<m>/std`


@dataclass
class LossStats:
    """Per-token statistics of a loss over micro-batches and ranks: sums with the tokens they were summed over
    (reported as means), and extremes. Each name is an objective's own metric name; a mean of squares beside its
    mean (`<m>/sq_mean` beside `<m>`) also gives the per-token standard deviation `<m>/std`."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)

    @classmethod
    def over_tokens(cls, sums: dict[str, float], count: float, mins=None, maxs=None) -> LossStats:
        """Statistics whose every sum runs over the same `count` tokens."""
        return cls(sums, dict.fromkeys(sums, count), mins or {}, maxs or {})

    @classmethod
    def totals(cls, sums: dict[str, float]) -> LossStats:
        """Counts reported as the step's totals, not as means: summed over tokens of no count (`metrics` divides a
        sum by its count, or by 1 where that is 0)."""
        return cls(dict(sums), dict.fromkeys(sums, 0.0))

    def add(self, other: LossStats) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0.0) + other.counts[k]
        for k, v in other.mins.items():
            self.mins[k] = min(self.mins.get(k, math.inf), v)
        for k, v in other.maxs.items():
            self.maxs[k] = max(self.maxs.get(k, -math.inf), v)

    def emptied(self) -> LossStats:
        """The same names with nothing in them: every rank must reduce the same names, even one given only fillers."""
        zeros = dict.fromkeys(self.sums, 0.0)
        return LossStats(zeros, dict(zeros), dict.fromkeys(self.mins, math.inf), dict.fromkeys(self.maxs, -math.inf))

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sums then counts, mins, maxs) as float64 tensors in name order: what a sum/min/max all-reduce wants."""
        names = sorted(self.sums)
        sums = [self.sums[k] for k in names] + [self.counts[k] for k in names]
        return (
            torch.tensor(sums, dtype=torch.float64),
            torch.tensor([self.mins[k] for k in sorted(self.mins)], dtype=torch.float64),
            torch.tensor([self.maxs[k] for k in sorted(self.maxs)], dtype=torch.float64),
        )

    def from_tensors(self, sums: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> LossStats:
        """These names with the values of `as_tensors`' shape (after the all-reduces)."""
        names, values = sorted(self.sums), sums.tolist()
        return LossStats(
            dict(zip(names, values[: len(names)], strict=True)),
            dict(zip(names, values[len(names) :], strict=True)),
            dict(zip(sorted(self.mins), mins.tolist(), strict=True)),
            dict(zip(sorted(self.maxs), maxs.tolist(), strict=True)),
        )

    def metrics(self) -> dict[str, float]:
        """Means over tokens, and the extremes that some token reached."""
        out = {k: v / max(self.counts[k], 1.0) for k, v in self.sums.items()}
        for name in [k.removesuffix(SQUARES) for k in out if k.endswith(SQUARES)]:
            if name in out and self.counts[name]:
                out[f"{name}/std"] = math.sqrt(max(0.0, out[name + SQUARES] - out[name] ** 2))
        out.update({k: v for k, v in self.mins.items() if v != math.inf})
        out.update({k: v for k, v in self.maxs.items() if v != -math.inf})
        return out


class Objective(ABC):
    """One term of the learner's loss: `annotate` on the rollout side, `loss` on the learner side."""

    kind: ClassVar[str]  # the name `objectives[].kind` gives it in the run's config
    streams: ClassVar[tuple[str, ...]]  # the per-token streams its loss reads (the sampler's, or what it annotated)

    def __init__(self, weight: float = 1.0):
        self.weight = weight  # of its loss in the learner's sum

    @classmethod
    @abstractmethod
    def from_config(cls, spec, cfg) -> Objective:
        """The objective of one `objectives` entry (`spec`: kind, weight and its own fields) in the run's config."""

    @abstractmethod
    def annotate(self, group: Group) -> None:
        """Write this objective's per-token streams into every sample of `group` (rollout side, before queueing)."""

    def num_tokens(self, streams: Mapping[str, torch.Tensor]) -> int:
        """How many of a micro-batch's trained tokens this objective's loss is averaged over: all of them, unless an
        objective says otherwise (the step's count, over all micro-batches and ranks, is its normaliser)."""
        return streams[SAMPLING_LOGPROBS].numel()

    def scored_ids(self, streams: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Token ids (`[targets, k]`, long) at which this objective's loss wants the learner's log-probs beside the
        sampled token's (top-k distillation: the teacher's top k), handed to its loss as `LEARNER_LOGPROBS_AT_IDS`;
        None: the sampled token's alone (what every loss but top-k distillation reads)."""
        return None

    @abstractmethod
    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        streams: Mapping[str, torch.Tensor],
        normalizer: float,
    ) -> tuple[torch.Tensor, LossStats]:
        """Its loss over one micro-batch's trained tokens, divided by `normalizer`, and its statistics.

        `logp` (with gradient) and `entropy` (without) are the learner's, at the sampling temperature, one entry per
        trained token; each stream has one entry per trained token too."""
