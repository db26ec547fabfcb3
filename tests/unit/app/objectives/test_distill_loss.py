"""The distill objective's loss, alone and beside GRPO, against references computed by hand from its definition
(Tinker's cookbook: advantage -coef x (sampler's log-prob - teacher's log-prob), importance-sampled loss)."""

import math

import pytest
import torch

from app.objectives import Objectives
from app.objectives.distill import CLIPPED, MAX_GAP, RATIO, REVERSE_KL, TEACHER_LOGPROBS, Distill, distill_loss
from app.objectives.grpo import ADVANTAGES, GRPO
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample
from core.config import load_config

NAN = math.nan


def _t(values, grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def test_distill_loss_and_its_gradient_match_the_hand_computed_reference():
    logp = _t([-1.0, -2.0, -0.5], grad=True)
    sampling = _t([-1.1, -2.0, -0.4])
    teacher = _t([-0.5, -3.0, NAN])  # the third token has no teacher log-prob: advantage 0, not counted
    loss, stats = distill_loss(logp, sampling, teacher, normalizer=4.0, coef=0.5)
    # gap = sampling - teacher = [-0.6, 1.0, -]; advantage = -0.5 * gap = [0.3, -0.5, 0]; ratio = exp(logp - sampling)
    r = [math.exp(0.1), 1.0, math.exp(-0.1)]
    assert loss.item() == pytest.approx(-(r[0] * 0.3 + r[1] * -0.5) / 4.0)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -ratio * A / N = -ratio * A / N
    assert grad.tolist() == pytest.approx([-r[0] * 0.3 / 4.0, 0.5 / 4.0, 0.0])
    # The reverse KL estimate is the mean gap over the scored tokens; the ratio's mean over them too.
    assert stats.metrics() == pytest.approx({REVERSE_KL: (-0.6 + 1.0) / 2, RATIO: (r[0] + r[1]) / 2, CLIPPED: 0.0})
    assert stats.counts == {REVERSE_KL: 2.0, RATIO: 2.0, CLIPPED: 2.0}


def test_a_token_the_teacher_rules_out_gets_a_bounded_advantage_not_one_of_ten_thousand():
    """vLLM answers a -inf log-prob as -9999.0; read back as -inf (`wire_logprob`), the token's gap is clipped at
    `max_gap` and counted as clipped."""
    from app.fleet_client import wire_logprob

    teacher_logp = wire_logprob(-9999.0)
    assert teacher_logp == -math.inf and wire_logprob(-2.5) == -2.5
    logp = _t([-1.0, -1.0], grad=True)
    loss, stats = distill_loss(logp, _t([-1.0, -1.0]), _t([teacher_logp, -1.5]), normalizer=2.0, coef=1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == pytest.approx([MAX_GAP / 2.0, 0.5 / 2.0])  # -ratio * advantage / N, the gap clipped
    assert stats.metrics()[CLIPPED] == pytest.approx(0.5)
    assert stats.metrics()[REVERSE_KL] == pytest.approx((MAX_GAP + 0.5) / 2)
    floored = distill_loss(_t([-1.0], grad=True), _t([-1.0]), _t([-9999.0]), normalizer=1.0, coef=1.0)[0]
    assert abs(floored.item()) <= MAX_GAP  # the floor itself, had it reached the loss, is clipped too


def test_the_rollout_takes_a_ruled_out_token_as_a_score_and_the_objective_keeps_the_group():
    from app.rollout.teacher import teacher_logprobs

    sample = Sample(completion_ids=[5, 6], sampling_logprobs=[-0.1, -0.2], reward=0.0)
    scores = teacher_logprobs([None, {5: -0.5}, {6: -math.inf}], 1, sample)
    assert scores == [-0.5, -math.inf]
    sample.streams[TEACHER_LOGPROBS] = scores
    Distill().annotate(Group(1, "p", [1], 0, [sample]))  # a score, not a hole: kept


def test_an_unreported_sampling_logprob_counts_as_agreement():
    logp = _t([-1.0], grad=True)
    loss, stats = distill_loss(logp, _t([NAN]), _t([-1.5]), normalizer=1.0, coef=1.0)
    # ratio 1, gap = logp - teacher = 0.5, advantage -0.5: loss 0.5
    assert loss.item() == pytest.approx(0.5) and stats.metrics()[REVERSE_KL] == pytest.approx(0.5)


def test_grpo_and_distill_add_as_hand_computed_and_their_advantages_add_on_policy():
    eps = 0.2
    logp = _t([-1.0, -0.7, -2.0, -0.3], grad=True)
    sampling = _t([-1.0, -1.0, -1.5, -0.3])
    teacher = _t([-0.8, -1.2, -1.0, -0.9])
    a_grpo = _t([1.0, 1.0, -0.5, -0.5])
    streams = {SAMPLING_LOGPROBS: sampling, ADVANTAGES: a_grpo, TEACHER_LOGPROBS: teacher}
    both = Objectives([GRPO(1.0, epsilon=eps, epsilon_high=eps), Distill(2.0, coef=0.5)])
    assert both.num_tokens([streams]) == [4, 4]
    loss, stats = both.loss(logp, torch.zeros(4, dtype=torch.float64), streams, [4.0, 4.0])

    expected = 0.0
    columns = ([-1.0, -0.7, -2.0, -0.3], [-1.0, -1.0, -1.5, -0.3], [-0.8, -1.2, -1.0, -0.9], [1.0, 1.0, -0.5, -0.5])
    for lp, sp, tp, ag in zip(*columns, strict=True):
        ratio = math.exp(lp - sp)
        clipped = min(max(ratio, 1 - eps), 1 + eps)
        grpo_token = -min(ratio * ag, clipped * ag)
        distill_token = -ratio * (-0.5 * (sp - tp))
        expected += grpo_token / 4.0 + 2.0 * distill_token / 4.0  # each divided by its token count, weighted
    assert loss.item() == pytest.approx(expected)
    assert stats.metrics()[REVERSE_KL] == pytest.approx(((-0.2) + 0.2 + (-0.5) + 0.6) / 4)
    assert "ratio" in stats.metrics()  # GRPO's own metrics stay under their (TRL's) names

    # On policy (logp = sampling, ratio 1, no clip) the gradient is the importance-sampled one of the summed
    # advantages, as in Tinker's cookbook: -(A_grpo + A_distill) / N per token.
    on_policy = sampling.clone().requires_grad_()
    plain = Objectives([GRPO(1.0, epsilon=eps, epsilon_high=eps), Distill(1.0, coef=0.5)])
    loss, _ = plain.loss(on_policy, torch.zeros(4, dtype=torch.float64), streams, [4.0, 4.0])
    (grad,) = torch.autograd.grad(loss, on_policy)
    a_distill = -0.5 * (sampling - teacher)
    assert torch.allclose(grad, -(a_grpo + a_distill) / 4.0)


def test_annotate_refuses_a_group_the_teacher_did_not_score_and_observations_are_not_counted():
    distill = Distill(coef=1.0)
    episode = Sample([5, 6, 7], [-0.1, NAN, -0.2], 1.0, completion_mask=[1, 0, 1])
    group = Group(0, "p", [1], 0, [episode])
    with pytest.raises(ValueError, match="no teacher log-probs"):
        distill.annotate(group)
    episode.streams[TEACHER_LOGPROBS] = [-0.3, NAN, NAN]  # the second model token unscored
    with pytest.raises(ValueError, match="unscored"):
        distill.annotate(group)
    episode.streams[TEACHER_LOGPROBS] = [-0.3, NAN, -0.4]  # NaN at the observation only: fine
    distill.annotate(group)
    assert distill.num_tokens({TEACHER_LOGPROBS: _t([-0.3, NAN, -0.4])}) == 2


def test_the_config_builds_distill_beside_grpo():
    cfg = load_config(None, ["objectives=[{kind: grpo}, {kind: distill, weight: 0.5, coef: 2.0, teacher: base}]"])
    grpo, distill = Objectives.from_config(cfg).objectives
    assert isinstance(grpo, GRPO) and isinstance(distill, Distill)
    assert (distill.weight, distill.coef, cfg.teacher.kind) == (0.5, 2.0, "base")


def test_several_teachers_report_their_own_reverse_kl():
    from app.objectives.distill import REVERSE_KL, TEACHER_INDEX, TEACHER_LOGPROBS, Distill
    from contracts.rollouts import SAMPLING_LOGPROBS

    objective = Distill(teachers=("math", "code"))
    assert TEACHER_INDEX in objective.streams and TEACHER_INDEX not in Distill.streams
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    streams = {
        SAMPLING_LOGPROBS: logp.clone(),
        TEACHER_LOGPROBS: torch.tensor([-1.5, -2.0, -1.0, float("nan")]),
        TEACHER_INDEX: torch.tensor([1.0, 1.0, 0.0, 0.0]),  # sorted: code 0, math 1
    }
    _, stats = objective.loss(logp, torch.zeros(4), streams, 3.0)
    metrics = stats.metrics()
    assert metrics["distill/math/reverse_kl"] == pytest.approx(0.75)
    assert metrics["distill/code/reverse_kl"] == pytest.approx(0.0) and stats.counts["distill/code/reverse_kl"] == 1
    assert metrics[REVERSE_KL] == pytest.approx(0.5)
