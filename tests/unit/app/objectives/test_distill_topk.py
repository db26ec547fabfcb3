"""Top-k distillation (`mode: topk`) on a toy vocabulary, against full-vocabulary references.

The learner's path end to end (its chunked log-probs at the teacher's top-k ids, `chunked_logprobs_at`, then the
distill objective's loss through `Objectives`, as the rank calls it) is checked, value and gradient into the hidden
states, against the same loss computed from the whole vocabulary's log-softmax with TRL 1.16's own functions
(`trl.experimental.sdft.loss_utils`); with k the whole vocabulary it is the full forward KL, reverse KL or
generalised JSD written out by hand.
"""

import json
import math
import warnings

import pytest
import torch

from app.learner.logprobs import chunked_logprobs_at
from app.objectives import Objectives
from app.objectives.distill import (
    CLIPPED,
    DIVERGENCE,
    IS_CLIPPED,
    RATIO,
    REVERSE_KL,
    STUDENT_MASS,
    TEACHER_LOGPROBS,
    TEACHER_MASS,
    Distill,
    add_tail_bucket,
    divergence,
    teacher_top_k,
    topk_distill_loss,
    topk_stream_names,
)
from app.objectives.grpo import ADVANTAGES, GRPO
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample
from core.config import ConfigError, load_config

VOCAB, HIDDEN, TOKENS, TEMPERATURE = 9, 5, 7, 0.8
ALPHAS = [0.0, 0.3, 0.5, 1.0]


def _toy(seed: int = 0):
    """Hidden states and output layer of a student, a teacher's logits, sampled tokens and sampling log-probs (some
    far enough below the student's that the importance weight passes 2 and is clipped)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    teacher_logits = 2 * torch.randn(TOKENS, VOCAB, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    student = torch.log_softmax(hidden @ weight.T / TEMPERATURE, -1).gather(-1, targets[:, None])[:, 0]
    sampling = student + torch.tensor([0.1, -1.2, 0.0, 0.4, -0.9, 0.2, -0.05], dtype=torch.float64)
    return hidden, weight, teacher_logits, targets, sampling


def _streams(teacher_logits, targets, sampling, k: int) -> dict[str, torch.Tensor]:
    """The micro-batch streams the rollout's teacher leaves (its sampled-token log-prob and top k), as float32."""
    teacher = torch.log_softmax(teacher_logits, -1)
    top = torch.topk(teacher, k, dim=-1)
    ids, logprobs = topk_stream_names(k)
    streams = {SAMPLING_LOGPROBS: sampling, TEACHER_LOGPROBS: teacher.gather(-1, targets[:, None])[:, 0]}
    streams.update({n: top.indices[:, j].double() for j, n in enumerate(ids)})
    streams.update({n: top.values[:, j] for j, n in enumerate(logprobs)})
    return {n: v.float() for n, v in streams.items()}


def _learner_loss(objective: Distill, hidden, weight, targets, streams, normalizer: float):
    """The loss as the learner computes it: float32, chunked log-probs at the ids the objective asks for."""
    objectives = Objectives([objective])
    ids = objectives.scored_ids(streams)
    logp, entropy, at_ids = chunked_logprobs_at(hidden, weight.float(), targets, ids, TEMPERATURE, chunk_tokens=3)
    return objectives.loss(logp, entropy, streams, [normalizer], at_ids)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_loss_and_its_gradient_match_a_full_vocabulary_reference_with_trls_functions(alpha, tail):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        from trl.experimental.sdft.loss_utils import (
            add_tail_bucket as trl_tail,
        )
        from trl.experimental.sdft.loss_utils import (
            apply_importance_sampling_clipping,
            compute_divergence,
        )

    k, coef, clip, normalizer = 4, 0.7, 2.0, 9.0
    hidden, weight, teacher_logits, targets, sampling = _toy()
    streams = _streams(teacher_logits, targets, sampling, k)
    h32 = hidden.float().requires_grad_()
    objective = Distill(coef=coef, top_k=k, alpha=alpha, tail=tail, is_clip=clip)
    loss, stats = _learner_loss(objective, h32, weight, targets, streams, normalizer)
    (grad,) = torch.autograd.grad(loss, h32)

    # The reference in float64 over the whole vocabulary: TRL's server top-k path (student gathered at the teacher's
    # top-k ids, tail bucket or renormalised, compute_divergence), its clipped importance weight, our normaliser.
    h64 = hidden.clone().requires_grad_()
    full = torch.log_softmax(h64 @ weight.T / TEMPERATURE, -1)
    teacher_full = torch.log_softmax(teacher_logits, -1)
    top_ids = torch.topk(teacher_full, k, dim=-1).indices
    s, t = full.gather(-1, top_ids), teacher_full.gather(-1, top_ids)
    if tail:
        s, t = trl_tail(s), trl_tail(t)
    else:
        s, t = s - torch.logsumexp(s, -1, keepdim=True), t - torch.logsumexp(t, -1, keepdim=True)
    per_token = compute_divergence(s, t, alpha)
    logp = full.gather(-1, targets[:, None])[:, 0]
    reference = coef * apply_importance_sampling_clipping(per_token, logp, sampling, clip).sum() / normalizer
    (reference_grad,) = torch.autograd.grad(reference, h64)

    assert abs(loss.item() - reference.item()) < 1e-5
    assert (grad.double() - reference_grad).abs().max().item() < 1e-5
    assert grad.abs().max().item() > 1e-3  # a gradient worth comparing
    ratio = torch.exp(logp.detach() - sampling)
    metrics = stats.metrics()
    assert metrics[DIVERGENCE] == pytest.approx(per_token.mean().item(), abs=1e-5)
    assert metrics[RATIO] == pytest.approx(ratio.mean().item(), abs=1e-5)
    assert metrics[IS_CLIPPED] == pytest.approx((ratio > clip).double().mean().item()) and metrics[IS_CLIPPED] > 0
    gap = (sampling - teacher_full.gather(-1, targets[:, None])[:, 0]).mean().item()
    assert metrics[REVERSE_KL] == pytest.approx(gap, abs=1e-5)  # the sampled-token estimate, as in sampled mode
    assert metrics[TEACHER_MASS] == pytest.approx(teacher_full.gather(-1, top_ids).exp().sum(-1).mean().item())
    assert metrics[STUDENT_MASS] == pytest.approx(full.gather(-1, top_ids).exp().sum(-1).mean().item(), abs=1e-6)


def _full_divergence(student: torch.Tensor, teacher: torch.Tensor, alpha: float) -> torch.Tensor:
    """Forward KL (alpha 0), reverse KL (alpha 1) or the generalised JSD over whole distributions, written out."""
    p, q = student.exp(), teacher.exp()
    if alpha == 0.0:
        return (q * (teacher - student)).sum(-1)
    if alpha == 1.0:
        return (p * (student - teacher)).sum(-1)
    m = (1 - alpha) * p + alpha * q
    return (1 - alpha) * (p * (student - m.log())).sum(-1) + alpha * (q * (teacher - m.log())).sum(-1)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_a_top_k_of_the_whole_vocabulary_is_the_full_divergence(alpha, tail):
    hidden, weight, teacher_logits, targets, _ = _toy(seed=1)
    full = torch.log_softmax(hidden @ weight.T / TEMPERATURE, -1)
    sampling = full.gather(-1, targets[:, None])[:, 0]  # on policy: importance weight 1
    streams = _streams(teacher_logits, targets, sampling, VOCAB)
    loss, stats = _learner_loss(
        Distill(top_k=VOCAB, alpha=alpha, tail=tail, is_clip=None), hidden.float(), weight, targets, streams, TOKENS
    )
    expected = _full_divergence(full, torch.log_softmax(teacher_logits, -1), alpha)
    assert abs(loss.item() - expected.mean().item()) < 1e-5
    assert stats.metrics()[TEACHER_MASS] == pytest.approx(1.0) and stats.metrics()[STUDENT_MASS] == pytest.approx(1.0)
    if alpha in (0.0, 1.0):  # the forward and reverse KL of one pair are not the same number
        other = _full_divergence(full, torch.log_softmax(teacher_logits, -1), 1.0 - alpha)
        assert abs(loss.item() - other.mean().item()) > 1e-2


def test_the_tail_bucket_holds_the_mass_outside_the_top_k():
    """With a tail, the divergence is the one of the coarse distributions (the k ids, then everything else as one
    category), never above the full one; without it, only the shape within the top k counts."""
    g = torch.Generator().manual_seed(3)
    student = torch.log_softmax(torch.randn(5, VOCAB, generator=g, dtype=torch.float64), -1)
    teacher = torch.log_softmax(2 * torch.randn(5, VOCAB, generator=g, dtype=torch.float64), -1)
    k = 3
    top = torch.topk(teacher, k, dim=-1).indices
    for alpha in ALPHAS:
        lumped = []
        for dist in (student, teacher):
            inside = dist.gather(-1, top)
            rest = torch.log1p(-inside.exp().sum(-1, keepdim=True))
            lumped.append(torch.cat([inside, rest], -1))
        expected = _full_divergence(lumped[0], lumped[1], alpha)
        got = divergence(add_tail_bucket(student.gather(-1, top)), add_tail_bucket(teacher.gather(-1, top)), alpha)
        assert torch.allclose(got, expected, atol=1e-12)
        assert (got <= _full_divergence(student, teacher, alpha) + 1e-12).all()  # lumping never adds divergence

    # A student with the teacher's shape on the top k but half its mass there: no loss without the tail, some with.
    teacher_top = torch.log(torch.tensor([[0.5, 0.3, 0.1]], dtype=torch.float64))
    student_top = teacher_top + math.log(0.5)
    logp = torch.tensor([-1.0], dtype=torch.float64)
    common = {"coef": 1.0, "alpha": 0.5, "is_clip": None}
    plain, _ = topk_distill_loss(logp, logp, logp, student_top, teacher_top, 1.0, tail=False, **common)
    tailed, _ = topk_distill_loss(logp, logp, logp, student_top, teacher_top, 1.0, tail=True, **common)
    assert abs(plain.item()) < 1e-12 and tailed.item() > 0.05


def test_a_ruled_out_id_leaves_the_support_and_an_unscored_token_costs_nothing_not_a_nan():
    g = torch.Generator().manual_seed(4)
    student = torch.log_softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1)[:, :4].requires_grad_()
    teacher = torch.log_softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1)[:, :4].clone()
    teacher[0, 3] = -math.inf  # the teacher rules its fourth id out at token 0
    teacher_logp = torch.tensor([-1.0, math.nan, -1.5], dtype=torch.float64)  # token 1 unscored
    teacher[1] = math.nan
    logp = torch.tensor([-1.2, -0.7, -1.1], dtype=torch.float64)
    for tail in (False, True):
        args = {"coef": 1.0, "alpha": 0.5, "tail": tail, "is_clip": 2.0}
        loss, stats = topk_distill_loss(logp, logp, teacher_logp, student, teacher, 2.0, **args)
        (grad,) = torch.autograd.grad(loss, student)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert (grad[1] == 0).all() and grad[0, 3] == 0  # nothing of the unscored token, nor of the ruled-out id
        alone = [
            topk_distill_loss(logp[i : i + 1], logp[i : i + 1], teacher_logp[i : i + 1], s, t, 2.0, **args)[0]
            for i, (s, t) in ((0, (student[:1, :3], teacher[:1, :3])), (2, (student[2:], teacher[2:])))
        ]
        assert loss.item() == pytest.approx(sum(x.item() for x in alone))  # token 0 as if over its 3 other ids
        assert stats.counts[DIVERGENCE] == 2.0


def test_the_importance_weight_is_clipped_detached_and_off_without_a_clip():
    student = torch.log(torch.tensor([[0.2, 0.3]], dtype=torch.float64)).requires_grad_()
    teacher = torch.log(torch.tensor([[0.5, 0.1]], dtype=torch.float64))
    logp, sampling, teacher_logp = (torch.tensor([v], dtype=torch.float64) for v in (-1.0, -3.0, -1.0))
    base = divergence(student - torch.logsumexp(student, -1, keepdim=True), teacher - teacher.logsumexp(-1, True), 1.0)
    args = {"coef": 1.0, "alpha": 1.0, "tail": False}
    clipped, stats = topk_distill_loss(logp, sampling, teacher_logp, student, teacher, 1.0, is_clip=2.0, **args)
    assert clipped.item() == pytest.approx(2.0 * base.item())  # ratio e^2 clipped at 2
    assert stats.metrics()[IS_CLIPPED] == 1.0 and stats.metrics()[RATIO] == pytest.approx(math.e**2)
    unclipped, stats = topk_distill_loss(logp, sampling, teacher_logp, student, teacher, 1.0, is_clip=None, **args)
    assert unclipped.item() == pytest.approx(math.e**2 * base.item()) and stats.metrics()[IS_CLIPPED] == 0.0
    assert stats.metrics()[CLIPPED] == 0.0


def _sample(k: int) -> Sample:
    ids, logprobs = topk_stream_names(k)
    sample = Sample([5, 6, 7], [-0.1, math.nan, -0.2], 1.0, completion_mask=[1, 0, 1])
    sample.streams[TEACHER_LOGPROBS] = [-0.3, math.nan, -0.4]
    sample.streams.update({n: [float(j), math.nan, float(j + 1)] for j, n in enumerate(ids)})
    sample.streams.update({n: [-1.0 - j, math.nan, -2.0 - j] for j, n in enumerate(logprobs)})
    return sample


def test_annotate_in_topk_mode_refuses_a_group_without_the_teachers_top_k():
    distill = Distill(top_k=2)
    Distill(top_k=2).annotate(Group(0, "p", [1], 0, [_sample(2)]))  # NaN at the observation only: fine
    missing = _sample(2)
    del missing.streams[topk_stream_names(2)[1][1]]
    with pytest.raises(ValueError, match="teacher_topk_logprobs/1"):
        distill.annotate(Group(0, "p", [1], 0, [missing]))
    hole = _sample(2)
    hole.streams[topk_stream_names(2)[0][0]][2] = math.nan
    with pytest.raises(ValueError, match="misses a model token"):
        distill.annotate(Group(0, "p", [1], 0, [hole]))
    Distill().annotate(Group(0, "p", [1], 0, [_sample(2)]))  # sampled mode reads none of them


def test_beside_grpo_each_objective_gets_its_own_loss_and_only_topk_asks_for_ids():
    k = 3
    hidden, weight, teacher_logits, targets, sampling = _toy(seed=2)
    streams = {**_streams(teacher_logits, targets, sampling, k), ADVANTAGES: torch.linspace(-1, 1, TOKENS)}
    grpo, distill = GRPO(1.0, epsilon=0.2, epsilon_high=0.2), Distill(0.5, top_k=k, alpha=0.0)
    both = Objectives([grpo, distill])
    assert Objectives([grpo, Distill()]).scored_ids(streams) is None
    ids = both.scored_ids(streams)
    assert ids.shape == (TOKENS, k) and ids.dtype == torch.long
    logp, entropy, at_ids = chunked_logprobs_at(hidden.float(), weight.float(), targets, ids, TEMPERATURE)
    total, _ = both.loss(logp, entropy, streams, [7.0, 7.0], at_ids)
    alone = [
        Objectives([o]).loss(logp, entropy, streams, [7.0], at_ids if o is distill else None)[0]
        for o in (grpo, distill)
    ]
    assert total.item() == pytest.approx(alone[0].item() + alone[1].item())  # each weighted as in the sum
    with pytest.raises(ValueError, match="scored_ids"):
        both.loss(logp, entropy, streams, [7.0, 7.0])


def test_the_config_of_topk_mode_is_validated_and_built():
    def distill(fields: str):
        return load_config(None, [f"objectives=[{{kind: distill, teacher: base{fields}}}]"])

    cfg = distill(", mode: topk, top_k: 5, alpha: 0.0, tail: true, is_clip: null")
    (objective,) = Objectives.from_config(cfg).objectives
    assert (objective.top_k, objective.alpha, objective.tail, objective.is_clip) == (5, 0.0, True, None)
    assert teacher_top_k(cfg) == 5 and teacher_top_k(distill("")) == 0
    assert Objectives.from_config(distill("")).objectives[0].top_k == 0  # sampled mode stays the default
    for bad, field in [
        (", mode: topk, top_k: 0", "top_k"),
        (", mode: topk, top_k: 21", "top_k"),  # beyond what the fleet answers
        (", mode: topk, alpha: 1.5", "alpha"),
        (", mode: topk, is_clip: 0", "is_clip"),
        (", mode: full", "mode"),
        (", top_k: 5", "only for mode topk"),  # sampled mode would ignore it
        (", tail: true", "only for mode topk"),
    ]:
        with pytest.raises(ConfigError, match=field):
            distill(bad)
    # A dumped sampled config, top-k fields at their defaults, loads again.
    dumped = distill("").objectives[0].model_dump(mode="json")
    assert load_config(None, [f"objectives=[{json.dumps(dumped)}]"]).objectives[0].mode == "sampled"


def test_the_config_bound_on_top_k_is_what_the_fleet_answers():
    from core.config.objectives import MAX_TEACHER_TOP_K
    from deployments.api.bodies import MAX_LOGPROBS

    assert MAX_TEACHER_TOP_K == MAX_LOGPROBS
