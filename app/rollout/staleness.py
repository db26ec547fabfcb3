"""How stale a group may be when the learner trains it, and where the rollout enforces it.

A group's staleness is the learner's version when it is taken minus the version of its oldest token
(a generation continued across weight updates carries several versions, `contracts.rollouts.VERSIONS`).
Two rules (`rollout.staleness_rule`):

- `drop_at_take`: groups are generated as fast as `max_inflight_tasks` and the queue allow, and one whose
  oldest token is more than `rollout.max_staleness` versions behind is dropped when taken: finished work
  thrown away, the longest generations (often the hardest problems) first.
- `bound_at_admission` (AReaL's staleness manager, Tinker's pacing): a group starts only while the groups
  admitted and not yet taken stay within what the learner consumes in `rollout.max_staleness` versions
  (`max_staleness x weight_sync_steps x num_prompts_per_step` groups, at least one step's), so that
  finished work is, as a rule, fresh enough to train, and is trained, corrected per token by the
  learner's ratio against the sampling log-probs; only a group whose oldest token is past a hard limit
  of its own (`rollout.hard_max_staleness`, an episode that outlived many versions) is dropped.

Either way a multi-turn group that could never be trained any more is stopped before its next turn.
`StalenessRule` holds the numbers; `figures` measures what is in flight and in the queue, as prime-rl
reports it (by the oldest token, the newest, and the token mean).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from app.messages import StalenessFigures

DROP_AT_TAKE = "drop_at_take"
BOUND_AT_ADMISSION = "bound_at_admission"


class StalenessRule:
    """`limit`: the most versions a group's oldest token may be behind the learner to be trained.
    `admission_bound`: the most groups admitted and not yet taken (None: no bound)."""

    def __init__(self, rule: str, max_staleness: int, hard_max_staleness: int, groups_per_version: int):
        if rule not in (DROP_AT_TAKE, BOUND_AT_ADMISSION):
            raise ValueError(f"staleness rule {rule!r}: expected {DROP_AT_TAKE} or {BOUND_AT_ADMISSION}")
        self.rule = rule
        self.limit = max_staleness if rule == DROP_AT_TAKE else hard_max_staleness
        self.admission_bound = None if rule == DROP_AT_TAKE else max(1, max_staleness) * groups_per_version

    @classmethod
    def from_config(cls, cfg) -> StalenessRule:
        r = cfg.rollout
        per_version = cfg.learner.weight_sync_steps * cfg.train.num_prompts_per_step
        return cls(r.staleness_rule, r.max_staleness, cfg.hard_max_staleness, per_version)

    def too_stale(self, learner_version: int, oldest_version: int) -> bool:
        """A group whose oldest token is this old can never be trained."""
        return learner_version - oldest_version > self.limit


def figures(learner_version: int, spans: Iterable[tuple[int, int, float | None]]) -> StalenessFigures | None:
    """Staleness of samples (or groups) by (version of the oldest token, of the newest, token mean or None if no
    token yet): each a mean over them; None for none."""
    spans = list(spans)
    if not spans:
        return None
    means = [learner_version - m for _, _, m in spans if m is not None]
    return StalenessFigures(
        count=len(spans),
        oldest=statistics.fmean(learner_version - o for o, _, _ in spans),
        oldest_max=max(learner_version - o for o, _, _ in spans),
        newest=statistics.fmean(learner_version - n for _, n, _ in spans),
        token_mean=statistics.fmean(means) if means else None,
    )
