"""The run's objectives together, as the config lists them: what the rollout and the learner each hold.

The rollout annotates every group with all of them; the learner's loss is their weighted sum, each
objective's term divided by its own token count over the step. Neither side names an algorithm.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from app.objectives.base import LEARNER_LOGPROBS_AT_IDS, LossStats, Objective
from app.objectives.distill import Distill
from app.objectives.grpo import GRPO
from contracts.rollouts import Group

KINDS: dict[str, type[Objective]] = {GRPO.kind: GRPO, Distill.kind: Distill}  # what `objectives[].kind` may name


def register_objective(objective: type[Objective]) -> type[Objective]:
    """Add an objective defined outside this package, by its `kind` (its config: `core.config.objectives.
    objectives_with`). Call it where its config is defined (at its module's import), so that every process that
    reads such a config (the rollout's, the learner's ranks, in Ray workers) has it too. The same class registered
    again (its module imported under a second name) replaces it; another class under a kind already taken is
    refused."""
    taken = KINDS.get(objective.kind)
    if taken is not None and taken.__qualname__ != objective.__qualname__:
        raise ValueError(f"objectives: kind {objective.kind!r} is already {taken.__qualname__}'s")
    KINDS[objective.kind] = objective
    return objective


class Objectives:
    """The objectives of one run, in config order."""

    def __init__(self, objectives: list[Objective]):
        if not objectives:
            raise ValueError("a run needs at least one objective")
        self.objectives = objectives

    @classmethod
    def from_config(cls, cfg) -> Objectives:
        """The objectives of `cfg.objectives` (read as attributes: the GPU bench passes a plain namespace)."""
        return cls([KINDS[spec.kind].from_config(spec, cfg) for spec in cfg.objectives])

    def annotate(self, group: Group) -> Group:
        """`group` with every objective's per-token streams written into its samples (rollout side)."""
        for objective in self.objectives:
            objective.annotate(group)
        return group

    def num_tokens(self, streams_of_batches: Iterable[Mapping[str, torch.Tensor]]) -> list[int]:
        """Each objective's token count over a step's micro-batches (all ranks'): what its loss is divided by."""
        counts = [0] * len(self.objectives)
        for streams in streams_of_batches:
            missing = sorted({name for o in self.objectives for name in o.streams} - streams.keys())
            if missing:
                raise ValueError(
                    f"the groups carry no {', '.join(missing)} stream: annotate them with the run's objectives "
                    "(app.objectives.Objectives.annotate) before the learner trains on them"
                )
            counts = [n + o.num_tokens(streams) for n, o in zip(counts, self.objectives, strict=True)]
        return counts

    def scored_ids(self, streams: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The ids every objective asked the learner's log-probs at (`Objective.scored_ids`), side by side
        (`[targets, sum of k]`), or None when none asks."""
        asked = [ids for o in self.objectives if (ids := o.scored_ids(streams)) is not None]
        return torch.cat(asked, dim=-1) if asked else None

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        streams: Mapping[str, torch.Tensor],
        normalizers: list[float],
        at_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        """The weighted sum of the objectives' losses over one micro-batch, and all their statistics.

        `at_ids` are the learner's log-probs at `scored_ids(streams)`: each objective that asked finds its own
        columns of them as `LEARNER_LOGPROBS_AT_IDS`."""
        total, stats, column = None, LossStats(), 0
        for objective, normalizer in zip(self.objectives, normalizers, strict=True):
            own_streams = streams
            if (ids := objective.scored_ids(streams)) is not None:
                if at_ids is None:
                    raise ValueError(f"{objective.kind}: its loss needs the learner's log-probs at its scored_ids")
                width = ids.shape[-1]
                own_streams = {**streams, LEARNER_LOGPROBS_AT_IDS: at_ids[:, column : column + width]}
                column += width
            loss, own = objective.loss(logp, entropy, own_streams, normalizer)
            total = loss * objective.weight if total is None else total + loss * objective.weight
            stats.add(own)
        return total, stats
