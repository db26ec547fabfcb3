"""The typed messages between the roles of a run, so that each side names what it hands over.

The learner answers each step with a `StepResult` and starts (or resumes) at a `ResumePoint`, which also
tells the rollout where to go on; the rollout reports `RolloutStats`. What the rollout hands the learner
(samples, groups, batches) is typed in `contracts.rollouts`, below both. Metrics are only metrics:
cursors, versions and audit lists travel in typed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.rollouts import BatchStats


@dataclass
class StepResult:
    """What one learner step answers: where the learner is now, which groups it trained, its metrics."""

    step: int
    policy_version: int
    trained_group_ids: list[int]  # the audit trail of exactly-once training (skipped groups excluded)
    metrics: dict[str, float]
    batch: BatchStats | None = None  # the step's groups, as the rollout handed them


@dataclass(frozen=True)
class ResumePoint:
    """Where the learner (re)starts and the rollout goes on: from the newest checkpoint, or from scratch."""

    step: int = 0
    policy_version: int = 0
    data_cursor: int | None = None
    consumed_group_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RolloutStats:
    """The rollout's counters and gauges; `metrics()` names them as they are logged (TRL's names where they exist)."""

    queue_size_at_take: int  # what the learner found when it last asked for groups
    queue_size_now: int
    inflight: int
    generated_tok_s: float
    dropped_stale_total: int
    dropped_stale_share: float
    dropped_failed_total: int
    request_retries_total: int
    groups_produced_total: int
    data_cursor: int
    data_frontier: int
    idle_s: float  # seconds with no generation request on the wire
    reward_metrics: dict[str, float] = field(default_factory=dict)
    env_errors_total: int = 0  # episodes an environment ended by raising or timing out
    teacher_failed_total: int | None = None  # groups dropped because the teacher failed to score them (distilling)

    def metrics(self) -> dict[str, float]:
        return {
            "sample/rollout_queue_size": self.queue_size_at_take,
            "rollout/queue_size_now": self.queue_size_now,
            "rollout/inflight": self.inflight,
            "rollout/generated_tok_s": self.generated_tok_s,
            "sample/dropped_stale_total": self.dropped_stale_total,
            "sample/dropped_stale_share": self.dropped_stale_share,
            "rollout/dropped_failed_total": self.dropped_failed_total,
            "rollout/request_retries_total": self.request_retries_total,
            "rollout/groups_produced_total": self.groups_produced_total,
            "rollout/data_cursor": self.data_cursor,
            "rollout/data_frontier": self.data_frontier,
            "rollout/idle_s": self.idle_s,
            "env/errors_total": self.env_errors_total,
            **(
                {} if self.teacher_failed_total is None else {"distill/teacher_failed_total": self.teacher_failed_total}
            ),
            **self.reward_metrics,
        }
