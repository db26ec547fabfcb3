"""What a rollout produces and a learner trains on, as types: samples, groups of them, and the batches of a step.

A group is the G completions of one prompt, sampled under one policy version (`policy-v{N}`); its
integer id is its index in the run's data order, unique per run, so a restarted learner can refuse
a group it already trained on (`ConsumedGroups`). The rollout hands the learner a `RolloutBatch` (scored groups plus the
data cursor to resume from) as an ObjectRef the driver never opens; `BatchStats` is what the driver
logs of it. `Generate` is how a sampler asks the fleet for completions (`app.fleet_client` speaks it
over HTTP; tests speak it with a fake), and `Choice` what it gets back.

Besides the sampling log-probs, a sample carries named per-token `streams` that the run's objectives
(`app.objectives`) attach on the rollout side (GRPO's `advantages`, for one); the learner lays every
stream out at the trained tokens without knowing what it means. The rollout's samplers attach one
more, `versions`: the policy version that sampled each token. A generation cut by a weight update and
continued under a newer version (`app.rollout.continuation`) spans several, and the learner's per-token
ratio against `sampling_logprobs` stays exact whichever version sampled which token; the rollout judges
a group's staleness by its oldest token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

SAMPLING_LOGPROBS = "sampling_logprobs"  # the stream every sample carries: the sampler's log-prob of each token
# The stream a rollout's sample carries: the policy version that sampled each token (NaN: none did, an observation).
VERSIONS = "versions"


@dataclass
class Choice:
    """One completion as a sampler gets it back from the fleet: token ids, their log-probs, the decoded text."""

    index: int
    token_ids: list[int]
    logprobs: list[float]  # the sampled tokens' log-probs at the sampling temperature
    text: str
    finish_reason: str | None  # "abort": cut (`POST /v1/cut`), with the tokens it had so far
    versions: list[int] | None = None  # per token, the policy version that sampled it (None: not known)

    def version_stream(self) -> list[float]:
        """`versions` as a per-token stream: NaN where no policy version is known."""
        if self.versions is None:
            return [math.nan] * len(self.token_ids)
        return [float(v) for v in self.versions]


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
    solved: bool | None = None  # an episode's verdict from its environment at the end, if it gave one
    # Per completion token, by name: what the run's objectives attached (read at model tokens only).
    streams: dict[str, list[float]] = field(default_factory=dict)
    # What the environment said last of an episode (its last observation, or its error): a self teacher's feedback.
    feedback: str = ""
    # An episode as its judges read it: its prompt and its completion as chat messages (the model's turns, the
    # environment's or its tools' replies), what `{transcript}` shows; None: a completion, read as its `text`.
    judged: tuple[Any, list[dict]] | None = None

    @property
    def succeeded(self) -> bool:
        """Held-out success: the environment's verdict when it gave one, else a positive reward (NaN is none)."""
        return self.solved if self.solved is not None else self.reward > 0

    def token_streams(self) -> dict[str, list[float]]:
        """Every per-token stream of the sample by name, its sampling log-probs included."""
        return {SAMPLING_LOGPROBS: self.sampling_logprobs, **self.streams}

    def model_token_ids(self) -> list[int]:
        """The tokens the model generated (and the learner trains), in order."""
        if self.completion_mask is None:
            return list(self.completion_ids)
        return [t for t, m in zip(self.completion_ids, self.completion_mask, strict=True) if m]

    def token_versions(self) -> list[int]:
        """The policy version that sampled each of the model's tokens, in order ([] when the sample carries none)."""
        return [int(v) for v in self.streams.get(VERSIONS, ()) if not math.isnan(v)]


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
    # What preparing it cost beyond sampling, by metric name (a teacher's seconds and tokens): summed per step.
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def is_episodic(self) -> bool:
        """Sampled as multi-turn episodes (by an environment) rather than single completions."""
        return any(s.turn_rewards is not None for s in self.samples)

    def num_tokens(self) -> int:
        return sum(len(self.prompt_ids) + len(s.completion_ids) for s in self.samples)

    @property
    def oldest_version(self) -> int:
        """The version of its oldest token, by which its staleness is judged (`policy_version` if none is known)."""
        return min((min(v) for s in self.samples if (v := s.token_versions())), default=self.policy_version)


@dataclass
class ConsumedGroups:
    """The group ids a run has trained on, kept as the data frontier and the few ids above it, however long it trains.

    Every id below `frontier` is settled: trained, or lost (dropped stale or failed) and never generated again, since
    a resumed rollout starts at the data frontier (`RolloutBatch.data_cursor`). Above it are the ids trained ahead of
    a group still in flight (`above`: as many as groups are in flight, not as many as were ever trained). A restarted
    rollout that goes on from an older checkpoint may generate ids below the frontier again: they count as consumed,
    trained or not, so no group is ever trained twice (one lost before is not given a second chance).
    """

    frontier: int = 0
    above: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, ids: Iterable[Any], frontier: int = 0) -> ConsumedGroups:
        """From a checkpoint's ids (ints, or the "g<index>" strings of old checkpoints; old ones list every id ever
        trained, those below `frontier` are dropped) and its frontier."""
        consumed = cls(frontier, {gid for gid in parse_group_ids(ids) if gid >= frontier})
        consumed._fold()
        return consumed

    def __contains__(self, group_id: object) -> bool:
        return isinstance(group_id, int) and (group_id < self.frontier or group_id in self.above)

    def add(self, group_id: int) -> None:
        if group_id >= self.frontier:
            self.above.add(group_id)
            self._fold()

    def advance(self, frontier: int | None) -> None:
        """Every id below `frontier` is settled now (the data frontier after a take; None: nothing known)."""
        if isinstance(frontier, int) and frontier > self.frontier:
            self.frontier = frontier
            self.above = {gid for gid in self.above if gid >= frontier}
        self._fold()

    def ids(self) -> list[int]:
        """The ids above the frontier, sorted (what a checkpoint stores beside the frontier)."""
        return sorted(self.above)

    def _fold(self) -> None:
        while self.frontier in self.above:  # trained in order: nothing to remember beyond the frontier
            self.above.remove(self.frontier)
            self.frontier += 1


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
    staleness: list[int]  # per group: learner version when taken minus the version of its oldest token
    version_min: int
    version_max: int
    episodes: EpisodeStats | None = None  # the multi-turn episodes among the groups, if any
    versions_per_sample: float = 1.0  # distinct versions among a sample's tokens, on average
    num_partial: int = 0  # samples whose tokens span more than one version (continued across a weight update)
    costs: dict[str, float] = field(default_factory=dict)  # the groups' `costs`, summed

    @classmethod
    def of(cls, groups: list[Group], learner_version: int | None) -> BatchStats | None:
        if not groups:
            return None
        rewards = [r for g in groups for r in g.rewards]
        scored = [r for r in rewards if not math.isnan(r)]  # an environment failure is no reward of 0
        oldest = [g.oldest_version for g in groups]
        spans = [len(set(s.token_versions())) or 1 for g in groups for s in g.samples]
        costs: dict[str, float] = {}
        for g in groups:
            for name, value in g.costs.items():
                costs[name] = costs.get(name, 0.0) + value
        return cls(
            num_samples=len(rewards),
            reward_mean=statistics.fmean(scored) if scored else math.nan,
            reward_std=statistics.pstdev(scored) if scored else math.nan,
            staleness=[] if learner_version is None else [learner_version - v for v in oldest],
            version_min=min(oldest),
            version_max=max(max(s.token_versions(), default=g.policy_version) for g in groups for s in g.samples),
            episodes=EpisodeStats.of([s for g in groups if g.is_episodic for s in g.samples]),
            versions_per_sample=statistics.fmean(spans),
            num_partial=sum(n > 1 for n in spans),
            costs=costs,
        )

    def metrics(self) -> dict[str, float]:
        out = {
            "reward": self.reward_mean,
            "reward_std": self.reward_std,
            "sample/version_min": self.version_min,
            "sample/version_max": self.version_max,
            "sample/versions_per_sample": self.versions_per_sample,
            "sample/partial_share": self.num_partial / self.num_samples,
            "samples": self.num_samples,
        }
        if self.staleness:
            out["sample/staleness_mean"] = statistics.fmean(self.staleness)
            out["sample/staleness_max"] = max(self.staleness)
            out["sample/groups"] = len(self.staleness)
        if self.episodes:
            out.update(self.episodes.metrics())
        out.update(self.costs)
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
