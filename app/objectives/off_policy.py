"""Rejecting or capping samples far off the learner's policy, beyond truncated importance sampling (TIS).

TIS caps each token's importance weight; a token or a sample whose learner/sampler ratio is far off still
contributes, capped. Two guards the frontier frameworks ship beside it (verl, SkyRL, TRL's
`vllm_importance_sampling_mode`), both off by default and both in the GRPO objective's config:

- **Sequence-level (MIS)**: a sample's ratio is the product of its tokens' (`exp` of the summed log-ratios), as
  TRL's `sequence_*` modes take it. `mask` drops a sample whose ratio leaves `[low, high]` (its tokens contribute
  nothing); `truncate` weights each of its tokens' losses by the ratio clamped into the band, the off-policy
  correction then carried at the sequence level (as TIS carries it per token, so the two are not combined).
- **Token-level (IcePop-style)**: a token whose ratio falls outside `[low, high]` contributes nothing, however far
  off; the others train as before.

Masked tokens still count in the loss's normaliser (as TRL's masks, a zero weight): masking lowers the step's
gradient rather than letting the surviving tokens speak louder. What each guard did is counted per step (tokens
and samples masked, samples capped, the share of tokens masked), and the drift alarm (`app.diagnosis`) reads the
share: a run that masks more and more is drifting off-policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from app.objectives.base import LossStats

MASKED_SHARE = "off_policy/masked_share"  # tokens that contribute nothing, by either mask, over all tokens
MASKED_TOKENS = "off_policy/masked_tokens"  # the step's count of tokens the token mask dropped
MASKED_SEQUENCES = "off_policy/masked_sequences"  # the step's count of samples the sequence mask dropped
TRUNCATED_SEQUENCES = "off_policy/truncated_sequences"  # the step's count of samples whose ratio was capped
SEQUENCE_RATIO = "off_policy/sequence_ratio"  # the samples' ratio: mean, and /min /max


@dataclass(frozen=True)
class OffPolicyMasks:
    """The guards of one GRPO objective (`GRPOObjectiveConfig`'s `sequence_is`, `token_mask` and their bands)."""

    sequence: Literal["off", "mask", "truncate"] = "off"
    sequence_low: float = 0.5
    sequence_high: float = 2.0
    token_mask: bool = False
    token_low: float = 0.5
    token_high: float = 2.0

    @property
    def active(self) -> bool:
        return self.sequence != "off" or self.token_mask

    @property
    def corrects(self) -> bool:
        """Whether these guards carry the off-policy correction themselves (sequence truncation), as TIS does."""
        return self.sequence == "truncate"


@dataclass
class OffPolicyWeights:
    """What the guards make of one micro-batch: a factor per token (0 for a masked token, the capped sequence ratio
    under truncation, else 1) and the statistics of what they did."""

    factor: torch.Tensor
    stats: LossStats


def sequence_sums(values: torch.Tensor, sample_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample of the micro-batch (in order of first appearance of its index), the sum of `values` over its
    tokens; and, per token, which of those samples it belongs to."""
    _, inverse = torch.unique(sample_index.to(torch.long), return_inverse=True)
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return sums, inverse


def off_policy_weights(
    log_ratio: torch.Tensor, sample_index: torch.Tensor | None, masks: OffPolicyMasks
) -> OffPolicyWeights:
    """The guards over one micro-batch's tokens: `log_ratio` is each token's learner/sampler log-ratio (detached),
    `sample_index` which sample each token belongs to (the learner's `SAMPLE_INDEX` stream; needed by the sequence
    guard)."""
    log_ratio = log_ratio.detach()
    factor = torch.ones_like(log_ratio)
    dropped = torch.zeros_like(log_ratio, dtype=torch.bool)
    sums: dict[str, float] = {}
    stats = LossStats()
    if masks.token_mask:
        ratio = torch.exp(log_ratio)
        outside = (ratio < masks.token_low) | (ratio > masks.token_high)
        dropped |= outside
        sums[MASKED_TOKENS] = float(outside.sum())
    if masks.sequence != "off":
        if sample_index is None:
            raise ValueError("sequence-level importance sampling needs each token's sample (the SAMPLE_INDEX stream)")
        seq_log_ratio, of_token = sequence_sums(log_ratio.to(torch.float64), sample_index)
        seq_ratio = torch.exp(seq_log_ratio)
        outside = (seq_ratio < masks.sequence_low) | (seq_ratio > masks.sequence_high)
        if masks.sequence == "mask":
            dropped |= outside[of_token]
            sums[MASKED_SEQUENCES] = float(outside.sum())
        else:
            factor = seq_ratio.clamp(masks.sequence_low, masks.sequence_high)[of_token].to(log_ratio.dtype)
            sums[TRUNCATED_SEQUENCES] = float(outside.sum())
        stats.add(LossStats.over_tokens({SEQUENCE_RATIO: float(seq_ratio.sum())}, float(seq_ratio.numel())))
        if seq_ratio.numel():
            stats.mins[f"{SEQUENCE_RATIO}/min"] = float(seq_ratio.min())
            stats.maxs[f"{SEQUENCE_RATIO}/max"] = float(seq_ratio.max())
    factor = factor.masked_fill(dropped, 0.0)
    stats.add(LossStats.totals(sums))
    stats.add(LossStats.over_tokens({MASKED_SHARE: float(dropped.sum())}, float(log_ratio.numel())))
    return OffPolicyWeights(factor, stats)
