"""What travels from the rollout side to the learner: scored groups of samples, tagged with a version.

A group is the G completions of one prompt, sampled under one policy version (`policy-v{N}`); its
id is unique per run, so a restarted learner can refuse a group it already trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def adapter_name(version: int) -> str:
    """The one spelling of a policy version's adapter name, shared by bucket, fleet and learner."""
    return f"policy-v{version}"


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

    group_id: str
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
