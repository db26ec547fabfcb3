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

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from app.fleet_client import Choice


def adapter_name(version: int, run: str | None = None) -> str:
    """The one spelling of a policy version's adapter name, shared by bucket, fleet and learner; on a shared
    fleet the run's name comes first (`alice/policy-v3`, `RunConfig.fleet_run`), in its bucket prefix it does not."""
    return f"{run}/policy-v{version}" if run else f"policy-v{version}"


class Generate(Protocol):
    """How the rollout and the evaluation sample from the fleet (`FleetClient.acompletions` is one)."""

    async def __call__(
        self,
        prompt_ids: list[int] | list[list[int]],  # one prompt, or a batch: `n` choices per prompt, in prompt order
        model: str,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        *,
        turn: int | None = None,  # a multi-turn episode's turn (1-based) that this request continues
    ) -> list[Choice]: ...


@dataclass
class Sample:
    """One completion: token ids as the sampler saw them, its log-probs and its reward.

    A multi-turn episode is one sample too: `completion_ids` is everything after the prompt (model turn 1,
    observation 1, model turn 2, ...), `completion_mask` marks the model's tokens (the only ones trained),
    and `sampling_logprobs` has vLLM's log-prob at each model token and NaN at each observation token.
    """

    completion_ids: list[int]
    sampling_logprobs: list[float]  # per completion token: vLLM's log-prob at the sampling temperature
    reward: float  # NaN: unscorable (an environment that failed), advantage 0
    truncated: bool = False  # stopped by max_completion_length (or an episode by its token budget or max_turns)
    text: str = ""
    completion_mask: list[int] | None = None  # 1 for a model token, 0 for an observation; None: all model tokens
    turn_rewards: list[float] | None = (
        None  # an episode's reward of each model turn it was scored on; None: single-turn
    )
    env_error: bool = False  # the environment raised or timed out and ended this episode
    num_turns: int = 1  # model turns (an episode's last may be unscored: cut by the budget, or its step failed)

    def model_token_ids(self) -> list[int]:
        """The tokens the model generated (and the learner trains), in order."""
        if self.completion_mask is None:
            return list(self.completion_ids)
        return [t for t, m in zip(self.completion_ids, self.completion_mask, strict=True) if m]


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

    @property
    def is_episodic(self) -> bool:
        """Sampled as multi-turn episodes (by an environment) rather than single completions."""
        return any(s.turn_rewards is not None for s in self.samples)

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
    episodes: EpisodeStats | None = None  # the multi-turn episodes among the groups, if any

    @classmethod
    def of(cls, groups: list[Group], learner_version: int | None) -> BatchStats | None:
        if not groups:
            return None
        rewards = [r for g in groups for r in g.rewards]
        scored = [r for r in rewards if not math.isnan(r)]  # an environment failure is no reward of 0
        versions = [g.policy_version for g in groups]
        return cls(
            num_samples=len(rewards),
            reward_mean=statistics.fmean(scored) if scored else math.nan,
            reward_std=statistics.pstdev(scored) if scored else math.nan,
            staleness=[] if learner_version is None else [learner_version - v for v in versions],
            version_min=min(versions),
            version_max=max(versions),
            episodes=EpisodeStats.of([s for g in groups if g.is_episodic for s in g.samples]),
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
        if self.episodes:
            out.update(self.episodes.metrics())
        return out


@dataclass(frozen=True)
class EpisodeStats:
    """Turns, truncation, environment failures and per-turn rewards of a step's multi-turn episodes."""

    num_episodes: int
    turns_mean: float
    turns_max: int
    truncated_share: float
    env_errors: int
    turn_reward_mean: tuple[float, ...]  # index k: mean reward of turn k + 1 over the episodes scored on it

    @classmethod
    def of(cls, samples: list[Sample]) -> EpisodeStats | None:
        if not samples:
            return None
        turns = [s.num_turns for s in samples]
        per_turn: list[list[float]] = [[] for _ in range(max(len(s.turn_rewards or ()) for s in samples))]
        for s in samples:
            for k, r in enumerate(s.turn_rewards or ()):
                per_turn[k].append(r)
        return cls(
            num_episodes=len(samples),
            turns_mean=statistics.fmean(turns),
            turns_max=max(turns),
            truncated_share=sum(s.truncated for s in samples) / len(samples),
            env_errors=sum(s.env_error for s in samples),
            turn_reward_mean=tuple(statistics.fmean(r) for r in per_turn),
        )

    def metrics(self) -> dict[str, float]:
        return {
            "env/episodes": float(self.num_episodes),
            "env/turns_mean": self.turns_mean,
            "env/turns_max": float(self.turns_max),
            "env/truncated_share": self.truncated_share,
            "env/errors": float(self.env_errors),
            **{f"env/turn_reward/{k + 1}": r for k, r in enumerate(self.turn_reward_mean)},
        }


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
    env_errors_total: int = 0  # episodes an environment ended by raising or timing out

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
            **self.reward_metrics,
        }
