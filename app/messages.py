"""The typed messages between the roles of a run, so that each side names what it hands over.

The learner answers each step with a `StepResult` and starts (or resumes) at a `ResumePoint`, which also
tells the rollout where to go on; the rollout reports `RolloutStats`. What the rollout hands the learner
(samples, groups, batches) is typed in `contracts.rollouts`, below both. Metrics are only metrics:
cursors, versions and audit lists travel in typed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.rollouts import BatchStats, ConsumedGroups


@dataclass
class StepResult:
    """What one learner step answers: where the learner is now, which groups it trained, its metrics."""

    step: int
    policy_version: int
    trained_group_ids: list[int]  # the audit trail of exactly-once training (skipped groups excluded)
    metrics: dict[str, float]
    batch: BatchStats | None = None  # the step's groups, as the rollout handed them
    # A spot notice's deadline left no time for the step: nothing trained, the state committed; the group trains the
    # same batch again on the node's replacement (`app.learner.notices`). `node_deadline`: when the node goes (unix).
    abandoned: bool = False
    node_deadline: float | None = None


@dataclass(frozen=True)
class ResumePoint:
    """Where the learner (re)starts and the rollout goes on: from the newest checkpoint, or from scratch."""

    step: int = 0
    policy_version: int = 0
    data_cursor: int | None = None
    # Groups trained (`contracts.rollouts.ConsumedGroups`): every id below the frontier, and those listed above it.
    consumed_group_ids: tuple[int, ...] = ()
    consumed_frontier: int = 0

    def consumed(self) -> ConsumedGroups:
        return ConsumedGroups.of(self.consumed_group_ids, self.consumed_frontier)


@dataclass(frozen=True)
class StalenessFigures:
    """Staleness of a set of samples (in flight, or in the queue) against the learner's version: the version of each
    one's oldest token, its newest, and its tokens' mean, each averaged over the samples (`app.rollout.staleness`)."""

    count: int  # samples (in the queue) or groups (in flight: a group's samples start and continue together)
    oldest: float
    oldest_max: int
    newest: float
    token_mean: float | None  # None: no token has come back yet

    def metrics(self, where: str) -> dict[str, float]:
        out = {
            f"sample/staleness_oldest/{where}": self.oldest,
            f"sample/staleness_oldest_max/{where}": float(self.oldest_max),
            f"sample/staleness_newest/{where}": self.newest,
        }
        if self.token_mean is not None:
            out[f"sample/staleness_token_mean/{where}"] = self.token_mean
        return out


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
    staleness_inflight: StalenessFigures | None = None  # the groups being sampled (by group: their samples start alike)
    staleness_queue: StalenessFigures | None = None  # the samples waiting in the queue
    cut_share: float = 0.0  # of the samples completed, the share cut by a weight update (and continued) at least once
    cuts_total: int = 0
    prefilled_again_total: int = 0  # tokens sent again as the prompt of a continuation after a cut
    teacher_failed_total: int | None = None  # groups dropped because the teacher failed to score them (distilling)
    teacher_failed_by: dict[str, int] = field(default_factory=dict)  # of several teachers, by name
    failing: str | None = None  # why the run cannot go on: every one of the last rollout.max_failed_groups failed
    zero_variance_share: float = 0.0  # of the groups scored, those whose rewards were all equal (no advantage)
    dropped_zero_variance_total: int = 0  # dropped by dynamic sampling: each one an extra group sampled in its place
    dropped_judge_failed_total: int = 0  # dropped because a judge with on_failure: drop failed to score them
    overlong_penalised_total: int = 0  # samples whose reward the overlong penalty lowered
    truncated_masked_total: int = 0  # truncated samples given no reward (rollout.mask_truncated)

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
            "rollout/cut_share": self.cut_share,
            "rollout/cuts_total": self.cuts_total,
            "rollout/prefilled_again_total": self.prefilled_again_total,
            "sample/zero_variance_share": self.zero_variance_share,
            "rollout/dropped_zero_variance_total": self.dropped_zero_variance_total,
            "rollout/dropped_judge_failed_total": self.dropped_judge_failed_total,
            "rollout/overlong_penalised_total": self.overlong_penalised_total,
            "rollout/truncated_masked_total": self.truncated_masked_total,
            **(self.staleness_inflight.metrics("inflight") if self.staleness_inflight else {}),
            **(self.staleness_queue.metrics("queue") if self.staleness_queue else {}),
            **(
                {} if self.teacher_failed_total is None else {"distill/teacher_failed_total": self.teacher_failed_total}
            ),
            **{f"distill/{name}/teacher_failed_total": n for name, n in self.teacher_failed_by.items()},
            **self.reward_metrics,
        }
