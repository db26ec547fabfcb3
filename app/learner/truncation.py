"""The sampler's truncation of each token's distribution (min-p, top-k, top-p), replayed on the learner's logits.

vLLM, in the `processed_logprobs` mode the fleet runs (`deployments.replica.engine`), reports a sampled token's
log-prob after everything its sampler did to the logits (`vllm.v1.sample.sampler.Sampler.sample`): temperature, then
min-p (`MinPLogitsProcessor`), then top-k and top-p (`topk_topp_sampler.apply_top_k_top_p`), then a log-softmax over
what survived. So the sampler's log-prob is normalised over the kept tokens only; a learner that normalises over the
whole vocabulary reads every ratio low by the kept mass (0.894 at top_p 0.7 on the embedded default), although the
policy did not move. The learner therefore takes its own log-probs under the same truncation, computed on its own
logits (as TRL 1.17, prime-rl and verl do): the ratio of two truncated policies is 1 for an unchanged policy, and the
loss's gradient is that of the policy the run actually samples from.

The kept set is a function of the logits and is treated as a constant (no gradient through the mask). The sampled
token is always kept: vLLM drew it, so it was in the sampler's set, and where the learner's logits differ from the
sampler's just enough to leave it out (numerical noise at the edge of the nucleus, or a policy that moved), a log-prob
of -inf would make a ratio of 0 and a NaN gradient out of a token that was legitimately sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """What the sampler keeps of each distribution after temperature, named as vLLM's `SamplingParams`."""

    top_k: int = -1  # the k most likely tokens (-1 or 0: all)
    top_p: float = 1.0  # the smallest set of most likely tokens whose probability reaches p (1: all)
    min_p: float = 0.0  # tokens at least min_p times as likely as the most likely (0: all)

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def of(cls, sampling) -> Truncation | None:
        """The truncation a run's `sampling` section asks of the fleet, or None where it keeps every token (read as
        attributes, each with vLLM's default: the GPU bench passes a namespace of the temperature alone)."""
        t = cls(getattr(sampling, "top_k", -1), getattr(sampling, "top_p", 1.0), getattr(sampling, "min_p", 0.0))
        return t if t.active else None


def kept(scaled: torch.Tensor, truncation: Truncation, targets: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row of `scaled` (logits after temperature, `[tokens, vocab]`) the sampler keeps, as vLLM
    0.32 decides it (min-p, then top-k, then top-p on the top-k renormalised), and each row's target besides."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if truncation.min_p > 0.0:
        # vLLM compares probabilities, p < min_p * max p; in logits that is s < max s + log(min_p).
        keep &= scaled >= scaled.amax(-1, keepdim=True) + math.log(truncation.min_p)
    if 0 < truncation.top_k < scaled.shape[-1]:
        kth = scaled.topk(truncation.top_k, dim=-1).values[:, -1:]
        keep &= scaled >= kth  # ties with the k-th are kept, as vLLM keeps them
    if truncation.top_p < 1.0:
        # vLLM's own steps: sort ascending, softmax over the kept, cumulative sum; a token whose sum (itself and
        # everything less likely) is at most 1 - p goes; the most likely always stays.
        masked = scaled.masked_fill(~keep, -math.inf)
        sorted_logits, order = masked.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - truncation.top_p
        drop[:, -1] = False
        keep &= ~torch.zeros_like(drop).scatter_(-1, order, drop)
    return keep.scatter_(-1, targets.unsqueeze(-1), True)


def truncate(scaled: torch.Tensor, truncation: Truncation | None, targets: torch.Tensor) -> torch.Tensor:
    """`scaled` with every token the sampler would not keep set to the dtype's lowest finite value, in place: a
    softmax gives it exactly 0 (so the log-softmax is over the kept tokens, as vLLM's), and `0 * value` stays 0 in
    the entropy where -inf would make NaN. Unchanged without a truncation."""
    if truncation is None or not truncation.active:
        return scaled
    return scaled.masked_fill_(~kept(scaled, truncation, targets), torch.finfo(scaled.dtype).min)
