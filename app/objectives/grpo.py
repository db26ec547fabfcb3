"""GRPO as an objective, with the semantics of TRL's AsyncGRPOTrainer, its loss as a plain tensor function.

The objective and the tests share these functions, so the hand-computed references in the tests check
exactly what trains. What TRL does, and so what we do:

- advantages are normalised within a group, `(r - mean) / (std + 1e-8)` with the *population* std
  (numpy's default, as in TRL's async rollout worker; TRL's synchronous GRPOTrainer uses the sample
  std instead). A sample whose reward is NaN (unscorable) gets advantage 0 and is left out of its
  group's mean and std. The rollout computes them (`GRPO.annotate`) and every token of a sample
  carries its sample's advantage (the `advantages` stream);
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
should sit at 1.000 right after a weight sync, and `ratio/std` its per-token spread: stale or drifting
samples widen it before any quality metric moves (`app.diagnosis`'s `drifting` verdict reads it).

Beyond TIS, two guards reject (or cap) samples far off the learner's policy, off by default: a sequence-level ratio
with masking or truncation (MIS) and a token-level mask of extreme ratios (IcePop-style); `app.objectives.off_policy`
says how, and counts what they did. The learner's log-probs are taken under the sampler's top-k/top-p
(`app.learner.truncation`), so every ratio here compares like with like.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from app.objectives.base import SAMPLE_INDEX, LossStats, Objective
from app.objectives.off_policy import OffPolicyMasks, off_policy_weights
from contracts.rollouts import SAMPLING_LOGPROBS, Group

ADVANTAGE_EPS = 1e-8
ADVANTAGES = "advantages"  # the stream GRPO annotates: its sample's group-normalised advantage, on every token
IS_RATIO = "sampling/importance_sampling_ratio"

# Metrics that are token means (TRL's names): summed over micro-batches and ranks, divided by the count once.
MEAN_METRICS = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "ratio/sq_mean",  # with `ratio`, the per-token spread of the ratio (`ratio/std`), which drift widens
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
    masks: OffPolicyMasks | None = None,
    sample_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective over a flat set of completion tokens, and its statistics.

    All tensors are 1-D, one entry per completion token. `normalizer` is the number of completion
    tokens the whole optimizer step divides by (see the module docstring); a micro-batch's loss is
    its share of that, so summing the backward passes of all micro-batches gives the step's gradient.
    A NaN sampling log-prob (vLLM did not report one) counts as agreement: ratio 1, as TRL does. `masks` are the
    off-policy guards beyond TIS (`app.objectives.off_policy`); the sequence guard needs each token's `sample_index`.
    """
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp.detach(), sampling_logp.to(logp.dtype))
    log_ratio_sampler = logp - sampling_logp
    if masks is not None and masks.corrects and tis_cap is not None:
        raise ValueError("sequence truncation carries the off-policy correction itself: not with TIS as well")
    guards = off_policy_weights(log_ratio_sampler, sample_index, masks) if masks and masks.active else None
    if masks is not None and masks.corrects:  # the proximal policy is the learner's own, as under TIS
        log_ratio = logp - logp.detach()
        is_weight = None
    elif tis_cap is None:
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
    if guards is not None:
        per_token_loss = per_token_loss * guards.factor
    loss = per_token_loss.sum() / normalizer
    with torch.no_grad():
        stats = _stats(logp, log_ratio_sampler, coef_1, advantages, epsilon, epsilon_high, is_weight, entropy)
    if guards is not None:
        stats.add(guards.stats)
    return loss, stats


def _stats(logp, log_ratio_sampler, coef_1, advantages, epsilon, epsilon_high, is_weight, entropy) -> LossStats:
    """The token sums of TRL's metrics (and the importance weights' extremes, with TIS)."""
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
        sampler_ratio.to(torch.float64).square().sum(),  # float64: a far-off token must not overflow it
    ]
    names = list(MEAN_METRICS)
    if is_weight is not None:
        terms.append(is_weight.sum())
        names.append(f"{IS_RATIO}/mean")
    values = torch.stack([t.to(torch.float64) for t in terms])  # one device-to-host copy, not eight
    stats = LossStats.over_tokens(dict(zip(names, values.tolist(), strict=True)), float(logp.numel()))
    if is_weight is not None and is_weight.numel():
        stats.mins[f"{IS_RATIO}/min"], stats.maxs[f"{IS_RATIO}/max"] = is_weight.min().item(), is_weight.max().item()
    return stats


class GRPO(Objective):
    """Group-normalised advantages on the rollout side; TRL's clipped loss, optionally with TIS, on the learner's."""

    kind = "grpo"
    streams = (SAMPLING_LOGPROBS, ADVANTAGES)

    def __init__(
        self,
        weight: float = 1.0,
        *,
        epsilon: float,
        epsilon_high: float,
        tis_cap: float | None = None,
        masks: OffPolicyMasks | None = None,
    ):
        super().__init__(weight)
        self.epsilon, self.epsilon_high, self.tis_cap = epsilon, epsilon_high, tis_cap
        self.masks = masks if masks is not None and masks.active else None

    @classmethod
    def from_config(cls, spec, cfg) -> GRPO:
        tis_cap = spec.vllm_importance_sampling_cap if spec.vllm_importance_sampling_correction else None
        off = OffPolicyMasks()  # the GPU bench passes a namespace without the guards: they stay off there
        masks = OffPolicyMasks(
            sequence=getattr(spec, "sequence_is", off.sequence),
            sequence_low=getattr(spec, "sequence_is_low", off.sequence_low),
            sequence_high=getattr(spec, "sequence_is_high", off.sequence_high),
            token_mask=getattr(spec, "token_mask", off.token_mask),
            token_low=getattr(spec, "token_mask_low", off.token_low),
            token_high=getattr(spec, "token_mask_high", off.token_high),
        )
        return cls(spec.weight, epsilon=spec.epsilon, epsilon_high=spec.epsilon_high, tis_cap=tis_cap, masks=masks)

    def annotate(self, group: Group) -> None:
        for sample, advantage in zip(group.samples, group_advantages(group.rewards), strict=True):
            sample.streams[ADVANTAGES] = [advantage] * len(sample.completion_ids)

    def loss(
        self, logp: torch.Tensor, entropy: torch.Tensor, streams: Mapping[str, torch.Tensor], normalizer: float
    ) -> tuple[torch.Tensor, LossStats]:
        return grpo_loss(
            logp,
            streams[SAMPLING_LOGPROBS],
            streams[ADVANTAGES],
            normalizer,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            tis_cap=self.tis_cap,
            entropy=entropy,
            masks=self.masks,
            sample_index=streams.get(SAMPLE_INDEX),
        )
