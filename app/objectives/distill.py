"""On-policy distillation as an objective: the reverse KL to a teacher at every token the student sampled.

The student samples; a teacher scores every sampled token (the rollout asks it before the group is queued,
`app.rollout.teacher`, and writes the `teacher_logprobs` stream); the learner pulls the student towards the
teacher where the student sampled. As Tinker's cookbook does it (`incorporate_kl_penalty` and its
importance-sampling loss):

- per sampled token, the advantage is `-coef * (sampling_logp - teacher_logp)`: the single-sample estimate of
  the reverse KL `KL(student || teacher)` at that token, negated. It needs nothing from the group, so
  distillation also trains where every sample of a group has the same reward (GRPO's advantage is 0 there);
- the loss is importance-sampled against the sampling log-probs, unclipped:
  `-sum(exp(logp - sampling_logp) * advantage) / normalizer`, the normaliser being the step's model tokens
  (over all micro-batches and ranks), as GRPO's is. Its gradient at the sampler's policy is the reverse KL's
  policy gradient (with a per-token reward).

With GRPO in the same run the two losses add, so the advantages add as they do in Tinker's cookbook: both
are divided by the same token count and, where GRPO's clip does not bind, their sum is the importance-sampled
loss of `grpo_advantage + distill_advantage`.

The per-token gap `sampling_logp - teacher_logp` is clipped at `max_gap` nats: a teacher that rules a sampled
token out (log-prob -inf, sent as vLLM's -9999.0) would otherwise give that one token an advantage of ~1e4, and
the step's whole update to it. `distill/clipped` is the share of tokens clipped so.

`distill/reverse_kl` is the mean of the (clipped) gap over the step's model tokens: the reverse KL of the
sampling policy to the teacher, estimated on the student's own samples (it falls as the student learns). Observation tokens of multi-turn episodes are never scored nor trained (the completion mask).
Teacher log-probs are the fleet's `prompt_logprobs` at the run's sampling temperature (`grpo.temperature`, which
the rollout sends with its scoring request): the sampling log-probs are after temperature, so the teacher's are
`log_softmax(teacher logits / T)` too, and the gap compares like with like (`deployments.replica.scoring_temperature`
is why a fleet's replica scores prompt tokens at the request's temperature; vLLM alone scores them at 1).

With several teachers (`teachers:`, each problem choosing one), every sample also carries its teacher's index
(`teacher_index`, among the sorted names), and the reverse KL is reported per teacher too
(`distill/<name>/reverse_kl`, over that teacher's tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from app.objectives.base import LossStats, Objective
from contracts.rollouts import SAMPLING_LOGPROBS, Group

TEACHER_LOGPROBS = "teacher_logprobs"  # the stream the rollout's teacher writes: its log-prob of each sampled token
TEACHER_INDEX = "teacher_index"  # with several teachers: which one scored the sample (its index among sorted names)
REVERSE_KL = "distill/reverse_kl"
RATIO = "distill/ratio"
CLIPPED = "distill/clipped"
MAX_GAP = 20.0  # nats: a token the teacher finds e^20 times less likely than the sampler counts as that unlikely


def teacher_metric(metric: str, name: str) -> str:
    """A distill metric (`distill/x`) of one teacher among several: `distill/<name>/x`."""
    return metric.replace("distill/", f"distill/{name}/", 1)


def distill_loss(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    normalizer: float,
    *,
    coef: float,
    max_gap: float = MAX_GAP,
) -> tuple[torch.Tensor, LossStats]:
    """The distillation loss over a flat set of model tokens, and its statistics.

    All tensors are 1-D, one entry per model token. A token without a teacher log-prob (NaN) has advantage 0
    and is not counted in the reverse KL; a NaN sampling log-prob counts as agreement (ratio 1), as in GRPO;
    a gap beyond `max_gap` (a teacher log-prob of -inf among them) counts as `max_gap`.
    """
    scored = ~torch.isnan(teacher_logp)
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp.detach(), sampling_logp.to(logp.dtype))
    raw_gap = sampling_logp - teacher_logp.to(logp.dtype)
    clipped = scored & (raw_gap > max_gap)
    gap = torch.where(scored, raw_gap.clamp(max=max_gap), torch.zeros_like(logp))
    advantages = -coef * gap
    ratio = torch.exp(logp - sampling_logp)
    loss = -(ratio * advantages).sum() / normalizer
    with torch.no_grad():
        n = float(scored.sum())
        sums = torch.stack([gap.sum(), (ratio * scored).sum(), clipped.sum()]).to(torch.float64).tolist()
        stats = LossStats.over_tokens(dict(zip((REVERSE_KL, RATIO, CLIPPED), sums, strict=True)), n)
    return loss, stats


class Distill(Objective):
    """Reverse KL to a teacher per sampled token: the teacher's log-probs come from the rollout (`app.rollout.teacher`)."""

    kind = "distill"
    streams = (SAMPLING_LOGPROBS, TEACHER_LOGPROBS)

    def __init__(
        self, weight: float = 1.0, *, coef: float = 1.0, max_gap: float = MAX_GAP, teachers: tuple[str, ...] = ()
    ):
        super().__init__(weight)
        self.coef, self.max_gap = coef, max_gap
        self.teachers = tuple(sorted(teachers))  # several: the reverse KL is reported per teacher too
        if self.teachers:
            self.streams = (*type(self).streams, TEACHER_INDEX)

    @classmethod
    def from_config(cls, spec, cfg) -> Distill:
        return cls(spec.weight, coef=spec.coef, max_gap=spec.max_gap, teachers=tuple(spec.teachers or ()))

    def annotate(self, group: Group) -> None:
        """The teacher scored the group already (asynchronous I/O, `app.rollout.teacher`): check that every model
        token of every sample has its log-prob, so that a group the teacher missed never reaches the learner."""
        for sample in group.samples:
            scores = sample.streams.get(TEACHER_LOGPROBS)
            if scores is None or len(scores) != len(sample.completion_ids):
                raise ValueError(f"group {group.group_id}: a sample has no teacher log-probs (was it scored?)")
            mask = sample.completion_mask or [1] * len(scores)
            if any(m and math.isnan(s) for s, m in zip(scores, mask, strict=True)):
                raise ValueError(f"group {group.group_id}: the teacher left a model token unscored")

    def num_tokens(self, streams: Mapping[str, torch.Tensor]) -> int:
        return int((~torch.isnan(streams[TEACHER_LOGPROBS])).sum())

    def loss(
        self, logp: torch.Tensor, entropy: torch.Tensor, streams: Mapping[str, torch.Tensor], normalizer: float
    ) -> tuple[torch.Tensor, LossStats]:
        teacher = streams[TEACHER_LOGPROBS]
        loss, stats = distill_loss(
            logp, streams[SAMPLING_LOGPROBS], teacher, normalizer, coef=self.coef, max_gap=self.max_gap
        )
        if self.teachers:
            stats.add(per_teacher_kl(logp, streams[SAMPLING_LOGPROBS], teacher, streams[TEACHER_INDEX], self))
        return loss, stats


@torch.no_grad()
def per_teacher_kl(logp, sampling_logp, teacher_logp, index, objective: Distill) -> LossStats:
    """`distill/<name>/reverse_kl` of each of several teachers: the mean clipped gap over the tokens it scored. Every
    name is there, with no tokens where a teacher scored none, so that every rank reduces the same names."""
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp, sampling_logp.to(logp.dtype))
    scored = ~torch.isnan(teacher_logp)
    gap = torch.where(scored, (sampling_logp - teacher_logp.to(logp.dtype)).clamp(max=objective.max_gap), 0.0)
    sums, counts = {}, {}
    for i, name in enumerate(objective.teachers):
        mine = scored & (index == i)
        key = teacher_metric(REVERSE_KL, name)
        sums[key], counts[key] = float(gap[mine].sum()), float(mine.sum())
    return LossStats(sums, counts)
