"""The typed messages between the roles, so that each side names what it hands over.

The rollout hands the learner a `RolloutBatch` (scored `Group`s plus the data cursor to resume
from); the learner answers each step with a `StepResult` and starts (or resumes) at a
`ResumePoint`, which also tells the rollout where to go on; the rollout reports `RolloutStats`.
A group is the G completions of one prompt, sampled under one policy version (`policy-v{N}`); its
integer id is its index in the run's data order, unique per run, so a restarted learner can refuse
a group it already trained on. Metrics are only metrics: cursors, versions and audit lists travel
in typed fields.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from app.fleet_client import Choice


def adapter_name(version: int) -> str:
    """The one spelling of a policy version's adapter name, shared by bucket, fleet and learner."""
    return f"policy-v{version}"


class Generate(Protocol):
    """How the rollout and the evaluation sample from the fleet (`FleetClient.acompletions` is one)."""

    async def __call__(
        self,
        prompt_ids: list[int],
        model: str,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[Choice]: ...


@dataclass
class Sample:
    """One completion: token ids as the sampler saw them, its log-probs and its reward."""

    completion_ids: list[int]
    sampling_logprobs: list[float]  # vLLM's log-prob of each completion token, at the sampling temperature
    reward: float
    truncated: bool = False  # stopped by max_completion_length rather than by EOS
    text: str = ""


@dataclass
class Group:
    """The G samples of one prompt, sampled under `policy_version`."""

    group_id: int
    problem_id: str
    prompt_ids: list[int]
    policy_version: int
    samples: list[Sample]
    created_at: float = 0.0
    reward_errors: dict[str, int] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def num_tokens(self) -> int:
        return sum(len(self.prompt_ids) + len(s.completion_ids) for s in self.samples)


def parse_group_ids(ids: Iterable[Any]) -> list[int]:
    """Group ids as stored in a checkpoint: ints, or the "g{index}" strings of checkpoints before ids were ints."""
    out = []
    for gid in ids:
        if isinstance(gid, int) and not isinstance(gid, bool):
            out.append(gid)
        elif isinstance(gid, str) and gid.startswith("g") and gid[1:].isdigit():
            out.append(int(gid[1:]))
        else:
            raise ValueError(f"checkpoint: group id {gid!r} is neither an int nor 'g<index>'")
    return out


@dataclass(frozen=True)
class BatchStats:
    """What the driver logs about a step's groups, computed where the groups are (the driver never opens them)."""

    num_samples: int
    reward_mean: float
    reward_std: float
    staleness: list[int]  # per group: learner version when taken minus sampling version
    version_min: int
    version_max: int

    @classmethod
    def of(cls, groups: list[Group], learner_version: int | None) -> BatchStats | None:
        if not groups:
            return None
        rewards = [r for g in groups for r in g.rewards]
        versions = [g.policy_version for g in groups]
        return cls(
            num_samples=len(rewards),
            reward_mean=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards),
            staleness=[] if learner_version is None else [learner_version - v for v in versions],
            version_min=min(versions),
            version_max=max(versions),
        )

    def metrics(self) -> dict[str, float]:
        out = {
            "reward": self.reward_mean,
            "reward_std": self.reward_std,
            "sample/version_min": self.version_min,
            "sample/version_max": self.version_max,
            "samples": self.num_samples,
        }
        if self.staleness:
            out["sample/staleness_mean"] = statistics.fmean(self.staleness)
            out["sample/staleness_max"] = max(self.staleness)
        return out


@dataclass
class RolloutBatch:
    """One step's groups as the rollout hands them to the learner.

    `data_cursor` is where a resumed rollout goes on (the learner checkpoints it); `learner_version`
    is the version the rollout measured staleness to when it took the groups.
    """

    groups: list[Group]
    data_cursor: int | None = None
    learner_version: int | None = None

    def stats(self) -> BatchStats | None:
        return BatchStats.of(self.groups, self.learner_version)


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
            **self.reward_metrics,
        }
