"""On-policy distillation as an objective: the reverse KL to a teacher at every token the student sampled (or, in
top-k mode, a divergence over the teacher's top k at every position).

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
Teacher log-probs are the fleet's `prompt_logprobs` at the run's sampling temperature (`sampling.temperature`, which
the rollout sends with its scoring request): the sampling log-probs are after temperature, so the teacher's are
`log_softmax(teacher logits / T)` too, and the gap compares like with like (`deployments.replica.scoring_temperature`
is why a fleet's replica scores prompt tokens at the request's temperature; vLLM alone scores them at 1).

**Top-k mode** (`mode: topk`), TRL 1.16's `topk_logits` distillation (`trl.experimental.sdft`: `loss_utils.py`'s
`compute_divergence`, `add_tail_bucket`, `apply_importance_sampling_clipping`, and `SDFTTrainer`'s
`_compute_server_distillation_loss`, which distils over the teacher's own top k as a server answers them). The
sampled token says little about the teacher's distribution; the fleet already answers its top-k alternatives with
`prompt_logprobs: k`. So the rollout keeps, per model token, the teacher's k most likely ids and their log-probs
(`TOPK_IDS` / `TOPK_LOGPROBS`: k streams each, one per rank, so that packing lays them out as any stream), the learner
computes its own log-probs at those ids (chunked, `app.learner.logprobs.chunked_logprobs_at`; asked through
`scored_ids`), and the per-token loss is a divergence between the two distributions on that support:

- without `tail`, both are renormalised over the top k (the divergence of the conditionals on it); with `tail`, one
  more bucket holds each side's mass outside it, `log(1 - sum exp(logp))`, so that the distributions sum to 1;
- the divergence is TRL's generalised JSD of `alpha`: `alpha = 0` the forward KL(teacher || student), `alpha = 1`
  the reverse KL(student || teacher), between them `(1 - alpha) KL(student || m) + alpha KL(teacher || m)` with
  the mixture `m = (1 - alpha) student + alpha teacher`. When k covers the vocabulary, it is the full divergence;
- the context was sampled by the sampler, not the learner: each token's loss is weighted by the importance ratio
  `exp(logp - sampling_logp)`, detached and clipped at `is_clip` (TRL's `distillation_is_clip`; none if null);
- the loss is `coef * sum(weight * divergence) / normalizer`, the step's scored model tokens, as in sampled mode.

A teacher log-prob of -inf among the top k (a teacher that rules out all but fewer than k tokens) leaves that id out
of the support on both sides. `distill/reverse_kl` is reported in both modes, from the sampled token as above, so
that runs of either mode compare; top-k mode adds `distill/divergence` (the mean per-token divergence, unweighted),
`distill/teacher_topk_mass` and `distill/student_topk_mass` (each side's probability on the teacher's top k),
`distill/is_clipped` (the share of tokens whose importance weight was clipped) beside `distill/ratio`.
With several teachers (`teachers:`, each problem choosing one), every sample also carries its teacher's index
(`teacher_index`, among the sorted names), and the reverse KL is reported per teacher too
(`distill/<name>/reverse_kl`, over that teacher's tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from app.objectives.base import LEARNER_LOGPROBS_AT_IDS, LossStats, Objective
from contracts.rollouts import SAMPLING_LOGPROBS, Group

TEACHER_LOGPROBS = "teacher_logprobs"  # the stream the rollout's teacher writes: its log-prob of each sampled token
TEACHER_INDEX = "teacher_index"  # with several teachers: which one scored the sample (its index among sorted names)
REVERSE_KL = "distill/reverse_kl"
RATIO = "distill/ratio"
CLIPPED = "distill/clipped"
MAX_GAP = 20.0  # nats: a token the teacher finds e^20 times less likely than the sampler counts as that unlikely
# Top-k mode: the streams of the teacher's j-th most likely token at each position, `f"{TOPK_IDS}/{j}"` its id (a
# float, exact below 2^24) and `f"{TOPK_LOGPROBS}/{j}"` its log-prob, j = 0 .. k - 1.
TOPK_IDS = "teacher_topk_ids"
TOPK_LOGPROBS = "teacher_topk_logprobs"
DIVERGENCE = "distill/divergence"
TEACHER_MASS = "distill/teacher_topk_mass"
STUDENT_MASS = "distill/student_topk_mass"
IS_CLIPPED = "distill/is_clipped"
IS_LOG_RATIO_BOUND = 20.0  # TRL clamps the log importance ratio so before exp
TAIL_LOG_MASS_MAX = -1e-7  # TRL's: a top k holding all the mass leaves a tail of about 1e-7, not log(0)


def teacher_top_k(cfg) -> int:
    """The alternatives per token the run's teacher is asked for: its distill objective's `top_k` in topk mode, else 0
    (the sampled token's log-prob alone)."""
    spec = next((o for o in cfg.objectives if o.kind == "distill"), None)
    return spec.top_k if spec is not None and getattr(spec, "mode", "sampled") == "topk" else 0


def topk_stream_names(k: int) -> tuple[list[str], list[str]]:
    """The names of the k id streams and the k log-prob streams of top-k mode, by rank."""
    return [f"{TOPK_IDS}/{j}" for j in range(k)], [f"{TOPK_LOGPROBS}/{j}" for j in range(k)]


def stacked_topk(streams: Mapping[str, torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids (long) and log-probs, `[targets, k]`, from the micro-batch's streams."""
    ids, logprobs = topk_stream_names(k)
    return (
        torch.stack([streams[n] for n in ids], dim=-1).long(),
        torch.stack([streams[n] for n in logprobs], dim=-1),
    )


def add_tail_bucket(log_probs: torch.Tensor) -> torch.Tensor:
    """One more category, the mass outside a support whose log-probs sum to at most 1 (TRL's `add_tail_bucket`)."""
    log_mass = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_mass))], dim=-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """KL(a || b) summed over the last dimension's entries in `support`; nothing outside it enters the arithmetic,
    so that an id left out (-inf on both sides) costs neither a NaN value nor a NaN gradient."""
    log_a = torch.where(support, log_a, torch.zeros_like(log_a))
    log_b = torch.where(support, log_b, torch.zeros_like(log_b))
    return torch.where(support, torch.exp(log_a) * (log_a - log_b), torch.zeros_like(log_a)).sum(-1)


def divergence(
    student: torch.Tensor, teacher: torch.Tensor, alpha: float, support: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's `compute_divergence` of two log-distributions over the last dimension (restricted to `support`):
    alpha 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), else the generalised JSD
    `(1 - alpha) KL(student || m) + alpha KL(teacher || m)`, `m = (1 - alpha) student + alpha teacher`."""
    if support is None:
        support = torch.ones_like(student, dtype=torch.bool)
    if alpha == 0.0:
        return _kl(teacher, student, support)
    if alpha == 1.0:
        return _kl(student, teacher, support)
    zero = torch.zeros_like(student)
    s, t = torch.where(support, student, zero), torch.where(support, teacher, zero)
    mixture = torch.logsumexp(torch.stack([s + math.log(1 - alpha), t + math.log(alpha)]), dim=0)
    return torch.lerp(_kl(s, mixture, support), _kl(t, mixture, support), alpha)


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
    scored, sampling_logp, gap, clipped = _sampled_gap(logp, sampling_logp, teacher_logp, max_gap)
    advantages = -coef * gap
    ratio = torch.exp(logp - sampling_logp)
    loss = -(ratio * advantages).sum() / normalizer
    with torch.no_grad():
        n = float(scored.sum())
        sums = torch.stack([gap.sum(), (ratio * scored).sum(), clipped.sum()]).to(torch.float64).tolist()
        stats = LossStats.over_tokens(dict(zip((REVERSE_KL, RATIO, CLIPPED), sums, strict=True)), n)
    return loss, stats


def _sampled_gap(logp, sampling_logp, teacher_logp, max_gap):
    """(scored, sampling log-probs with NaN read as the learner's, the clipped gap (0 where unscored), clipped)."""
    scored = ~torch.isnan(teacher_logp)
    sampling_logp = torch.where(torch.isnan(sampling_logp), logp.detach(), sampling_logp.to(logp.dtype))
    raw_gap = sampling_logp - teacher_logp.to(logp.dtype)
    clipped = scored & (raw_gap > max_gap)
    gap = torch.where(scored, raw_gap.clamp(max=max_gap), torch.zeros_like(logp))
    return scored, sampling_logp, gap, clipped


def topk_distill_loss(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_topk: torch.Tensor,
    teacher_topk: torch.Tensor,
    normalizer: float,
    *,
    coef: float,
    alpha: float,
    tail: bool,
    is_clip: float | None,
    max_gap: float = MAX_GAP,
) -> tuple[torch.Tensor, LossStats]:
    """The top-k distillation loss over a flat set of model tokens, and its statistics (the module says how).

    `logp`, `sampling_logp` and `teacher_logp` are 1-D, the sampled token's, one entry per model token;
    `student_topk` (the learner's, with gradient) and `teacher_topk` are `[tokens, k]`, at the teacher's top-k ids.
    A token without a teacher log-prob (NaN) costs nothing and is not counted; a NaN sampling log-prob counts as
    agreement (importance weight 1).
    """
    scored, sampling_logp, gap, clipped = _sampled_gap(logp, sampling_logp, teacher_logp, max_gap)
    teacher_topk = teacher_topk.to(student_topk.dtype)
    support = teacher_topk > -math.inf  # NaN and -inf alike: no such id in the teacher's top k
    scored = scored & support.any(-1)
    # A token that is not scored gets a finite stand-in (its loss is zeroed below), so that no NaN reaches a gradient.
    teacher_topk = torch.where(scored.unsqueeze(-1), teacher_topk, torch.zeros_like(teacher_topk))
    support = support | ~scored.unsqueeze(-1)
    minus_inf = torch.full_like(student_topk, -math.inf)
    student = torch.where(support, student_topk, minus_inf)
    teacher = torch.where(support, teacher_topk, minus_inf)
    with torch.no_grad():
        teacher_mass = torch.exp(torch.logsumexp(teacher, dim=-1))
        student_mass = torch.exp(torch.logsumexp(student, dim=-1))
    if tail:
        student, teacher = add_tail_bucket(student), add_tail_bucket(teacher)
        support = torch.cat([support, torch.ones_like(support[:, :1])], dim=-1)
    else:
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    per_token = divergence(student, teacher, alpha, support)
    log_ratio = (logp.detach() - sampling_logp).clamp(-IS_LOG_RATIO_BOUND, IS_LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    weight = ratio if is_clip is None else ratio.clamp(max=is_clip)
    weighted = torch.where(scored, weight * per_token, torch.zeros_like(per_token))
    loss = coef * weighted.sum() / normalizer
    with torch.no_grad():
        n = float(scored.sum())
        zero = torch.zeros_like(per_token)
        over = scored & (ratio > is_clip) if is_clip is not None else torch.zeros_like(scored)
        values = {
            REVERSE_KL: gap.sum(),
            DIVERGENCE: torch.where(scored, per_token, zero).sum(),
            RATIO: (ratio * scored).sum(),
            CLIPPED: clipped.sum(),
            IS_CLIPPED: over.sum(),
            TEACHER_MASS: torch.where(scored, teacher_mass, zero).sum(),
            STUDENT_MASS: torch.where(scored, student_mass, zero).sum(),
        }
        sums = torch.stack(list(values.values())).to(torch.float64).tolist()
        stats = LossStats.over_tokens(dict(zip(values, sums, strict=True)), n)
    return loss, stats


class Distill(Objective):
    """Reverse KL to a teacher per sampled token, or (`top_k`) a divergence over the teacher's top k: the teacher's
    log-probs come from the rollout (`app.rollout.teacher`)."""

    kind = "distill"
    streams = (SAMPLING_LOGPROBS, TEACHER_LOGPROBS)

    def __init__(
        self,
        weight: float = 1.0,
        *,
        coef: float = 1.0,
        max_gap: float = MAX_GAP,
        top_k: int = 0,
        alpha: float = 0.5,
        tail: bool = False,
        is_clip: float | None = 2.0,
        teachers: tuple[str, ...] = (),
    ):
        """`top_k` 0: sampled mode; above: top-k mode over that many of the teacher's ids, with `alpha`, `tail`
        and `is_clip` (unused in sampled mode). `teachers`: the names of several, whose reverse KL is reported each."""
        super().__init__(weight)
        if top_k < 0 or not 0.0 <= alpha <= 1.0 or (is_clip is not None and is_clip <= 0):
            raise ValueError(f"distill: top_k {top_k} >= 0, alpha {alpha} in [0, 1], is_clip {is_clip} > 0 or None")
        self.coef, self.max_gap = coef, max_gap
        self.top_k, self.alpha, self.tail, self.is_clip = top_k, alpha, tail, is_clip
        self.teachers = tuple(sorted(teachers))
        if top_k:
            ids, logprobs = topk_stream_names(top_k)
            self.streams = (*self.streams, *ids, *logprobs)
        if self.teachers:
            self.streams = (*self.streams, TEACHER_INDEX)

    @classmethod
    def from_config(cls, spec, cfg) -> Distill:
        common = {"coef": spec.coef, "max_gap": spec.max_gap, "teachers": tuple(spec.teachers or ())}
        if getattr(spec, "mode", "sampled") == "sampled":
            return cls(spec.weight, **common)
        return cls(spec.weight, top_k=spec.top_k, alpha=spec.alpha, tail=spec.tail, is_clip=spec.is_clip, **common)

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
            for name in self.streams[2:]:  # top-k mode's: the teacher's ids and log-probs at every model token
                values = sample.streams.get(name)
                if values is None or len(values) != len(scores):
                    raise ValueError(f"group {group.group_id}: a sample has no {name} (scored with top k?)")
                if any(m and math.isnan(v) for v, m in zip(values, mask, strict=True)):
                    raise ValueError(f"group {group.group_id}: {name} misses a model token")

    def num_tokens(self, streams: Mapping[str, torch.Tensor]) -> int:
        return int((~torch.isnan(streams[TEACHER_LOGPROBS])).sum())

    def scored_ids(self, streams: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        return stacked_topk(streams, self.top_k)[0] if self.top_k else None

    def loss(
        self, logp: torch.Tensor, entropy: torch.Tensor, streams: Mapping[str, torch.Tensor], normalizer: float
    ) -> tuple[torch.Tensor, LossStats]:
        teacher = streams[TEACHER_LOGPROBS]
        if not self.top_k:
            loss, stats = distill_loss(
                logp, streams[SAMPLING_LOGPROBS], teacher, normalizer, coef=self.coef, max_gap=self.max_gap
            )
        else:
            loss, stats = topk_distill_loss(
                logp,
                streams[SAMPLING_LOGPROBS],
                teacher,
                streams[LEARNER_LOGPROBS_AT_IDS],
                stacked_topk(streams, self.top_k)[1],
                normalizer,
                coef=self.coef,
                alpha=self.alpha,
                tail=self.tail,
                is_clip=self.is_clip,
                max_gap=self.max_gap,
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
