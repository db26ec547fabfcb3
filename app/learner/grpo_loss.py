"""GRPO's policy loss, with the semantics of TRL's AsyncGRPOTrainer, as plain tensor functions.

The learner and the tests share these functions, so the hand-computed references in the tests check
exactly what trains. What TRL does, and so what we do:

- advantages are normalised within a group, `(r - mean) / (std + 1e-8)` with the *population* std
  (numpy's default, as in TRL's async rollout worker; TRL's synchronous GRPOTrainer uses the sample
  std instead). A sample whose reward is NaN (unscorable) gets advantage 0 and is left out of its
  group's mean and std;
- the per-token ratio is `exp(logp - sampling_logp)`: the learner's log-prob at the sampling
  temperature against the one vLLM reported when it sampled the token. There is no separate "old"
  forward pass: the sampler *is* the behaviour policy, however many versions stale it is;
- the objective is `-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)`, summed over
  completion tokens and divided by a normaliser the caller passes: the number of completion tokens
  in the whole optimizer step, over all micro-batches and ranks. (TRL divides by each micro-batch's
  token count and then by the accumulation steps; dividing once by the step's total makes the
  gradient independent of how the step is cut into micro-batches, which is what lets packed and
  padded batches give the same update.)

Truncated importance sampling (TIS), optional, follows TRL's GRPOTrainer with one optimisation pass
per batch: the proximal ("old") policy is the learner's own current log-prob, detached, so the PPO
ratio is exactly 1 (the clip never bites) and the off-policy correction is carried by the
truncated weight `min(exp(logp.detach() - sampling_logp), cap)` that multiplies each token's loss.
The `ratio` metric always reports `exp(logp - sampling_logp)`, the learner/sampler agreement that
should sit at 1.000 right after a weight sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

ADVANTAGE_EPS = 1e-8

# Metrics that are token means: accumulated as sums over micro-batches and ranks, divided by the count once.
MEAN_METRICS = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "sampling/importance_sampling_ratio/mean",
)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """Advantages of one group: `(r - mean) / (std + 1e-8)`, population std, NaN rewards get 0."""
    r = np.asarray(rewards, dtype=float)
    scored = ~np.isnan(r)
    advantages = np.zeros_like(r)
    if scored.any():
        s = r[scored]
        advantages[scored] = (s - s.mean()) / (s.std() + ADVANTAGE_EPS)
    return advantages.tolist()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, both at `temperature`.

    vLLM (with `logprobs_mode="processed_logprobs"`) reports log-probs of the tempered distribution
    it sampled from, so the learner must divide its logits by the same temperature before the
    softmax, or the ratio is off on every token. The softmax runs in float32 (float64 stays float64)
    whatever the model's dtype, so it adds no bfloat16 rounding of its own. Entropy carries no gradient.
    """
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logp, entropy


@dataclass
class LossStats:
    """Sums (and extremes) over the tokens of one or more micro-batches, reduced to means at the end."""

    sums: dict[str, float]
    count: float
    is_min: float = math.inf
    is_max: float = -math.inf

    @classmethod
    def empty(cls) -> LossStats:
        return cls({k: 0.0 for k in MEAN_METRICS}, 0.0)

    def add(self, other: LossStats) -> None:
        for k, v in other.sums.items():
            self.sums[k] += v
        self.count += other.count
        self.is_min = min(self.is_min, other.is_min)
        self.is_max = max(self.is_max, other.is_max)

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sums + count, min, max) as float64 tensors, the shape a sum/min/max all-reduce wants."""
        sums = torch.tensor([self.sums[k] for k in MEAN_METRICS] + [self.count], dtype=torch.float64)
        return sums, torch.tensor([self.is_min], dtype=torch.float64), torch.tensor([self.is_max], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, is_min: torch.Tensor, is_max: torch.Tensor) -> LossStats:
        values = sums.tolist()
        return cls(dict(zip(MEAN_METRICS, values[:-1], strict=True)), values[-1], is_min.item(), is_max.item())

    def metrics(self, tis: bool) -> dict[str, float]:
        count = max(self.count, 1.0)
        out = {k: v / count for k, v in self.sums.items()}
        if tis and self.count:
            out["sampling/importance_sampling_ratio/min"] = self.is_min
            out["sampling/importance_sampling_ratio/max"] = self.is_max
        else:
            out.pop("sampling/importance_sampling_ratio/mean")
        return out


def grpo_loss(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    advantages: torch.Tensor,
    normalizer: float,
    *,
    epsilon: float,
    epsilon_high: float,
    tis_cap: float | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective over a flat set of completion tokens, and its statistics.

    All tensors are 1-D, one entry per completion token. `normalizer` is the number of completion
    tokens the whole optimizer step divides by (see the module docstring); a micro-batch's loss is
    its share of that, so summing the backward passes of all micro-batches gives the step's gradient.
    A NaN sampling log-prob (vLLM did not report one) counts as agreement: ratio 1, as TRL does.
    """
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp.detach(), sampling_logp.to(logp.dtype))
    log_ratio_sampler = logp - sampling_logp
    if tis_cap is None:
        log_ratio = log_ratio_sampler
        is_weight = None
    else:
        log_ratio = logp - logp.detach()
        is_weight = torch.exp(log_ratio_sampler.detach()).clamp(max=tis_cap)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if is_weight is not None:
        per_token_loss = per_token_loss * is_weight
    loss = per_token_loss.sum() / normalizer

    with torch.no_grad():
        sampler_ratio = torch.exp(log_ratio_sampler)
        is_low = (coef_1 < 1 - epsilon) & (advantages < 0)
        is_high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        zero = torch.zeros((), dtype=torch.float64, device=logp.device)
        terms = [
            sampler_ratio.sum(),
            # TRL's `kl` metric: the k3 estimator (r - 1) - log r of the learner/sampler divergence.
            ((sampler_ratio - 1) - log_ratio_sampler).sum(),
            entropy.sum() if entropy is not None else zero,
            is_low.sum(),
            is_high.sum(),
            (is_low | is_high).sum(),
            is_weight.sum() if is_weight is not None else zero,
        ]
        values = torch.stack([t.to(torch.float64) for t in terms])  # one device-to-host copy, not seven
        stats = LossStats(dict(zip(MEAN_METRICS, values.tolist(), strict=True)), float(logp.numel()))
        if is_weight is not None and is_weight.numel():
            stats.is_min, stats.is_max = is_weight.min().item(), is_weight.max().item()
    return loss, stats
