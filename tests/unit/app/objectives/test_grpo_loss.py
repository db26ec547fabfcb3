"""The GRPO objective against references computed by hand (numpy, float64, explicit formulas).

The loss goes through the objective's learner-side interface (`GRPO.loss` over named streams), as the
learner calls it. The learnable tensor is the logits themselves, so the reference gradient can be written out:
d loss / d logp_t = -A_t * ratio_t / N on tokens where the unclipped term is the minimum, 0 where the
clipped one is; d logp_t / d logits = (onehot - softmax(logits / T)) / T.
"""

import math

import numpy as np
import pytest
import torch

from app.learner.logprobs import token_logprobs
from app.objectives.grpo import ADVANTAGES, GRPO, group_advantages, grpo_loss
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample

EPS_LOW, EPS_HIGH = 0.2, 0.28


def test_group_advantages_population_std_and_unscored_rewards():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean, std = 0.6, math.sqrt(sum((r - 0.6) ** 2 for r in rewards) / 5)  # population, like numpy's default
    assert group_advantages(rewards) == pytest.approx([(r - mean) / (std + 1e-8) for r in rewards])
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # no signal, no NaN
    adv = group_advantages([1.0, float("nan"), 0.0])
    assert adv[1] == 0.0 and adv[0] == pytest.approx(1.0, abs=1e-6) and adv[2] == pytest.approx(-1.0, abs=1e-6)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _case(log_ratio_offsets, advantages, temperature=0.7, vocab=11, seed=0):
    """Logits, targets and sampling log-probs placed so that each token's ratio is exp(offset)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(advantages), vocab))
    targets = rng.integers(0, vocab, size=len(advantages))
    logp = _log_softmax(logits / temperature)[np.arange(len(targets)), targets]
    sampling = logp - np.asarray(log_ratio_offsets)
    return logits, targets, sampling, np.asarray(advantages, dtype=float), temperature


def _torch_loss(logits, targets, sampling, adv, temperature, normalizer, tis_cap=None):
    leaf = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    logp, entropy = token_logprobs(leaf, torch.tensor(targets), temperature)
    objective = GRPO(epsilon=EPS_LOW, epsilon_high=EPS_HIGH, tis_cap=tis_cap)
    streams = {SAMPLING_LOGPROBS: torch.tensor(sampling), ADVANTAGES: torch.tensor(adv)}
    assert objective.num_tokens(streams) == len(targets)  # GRPO averages over every trained token
    loss, stats = objective.loss(logp, entropy, streams, normalizer)
    loss.backward()
    return loss.item(), leaf.grad.numpy(), stats.metrics()


def _reference(logits, targets, sampling, adv, temperature, normalizer, tis_cap=None):
    n, vocab = logits.shape
    logq = _log_softmax(logits / temperature)
    q = np.exp(logq)
    logp = logq[np.arange(n), targets]
    ratio = np.exp(logp - sampling)
    loss, dlogp = 0.0, np.zeros(n)
    for t in range(n):
        if tis_cap is None:
            clipped = min(max(ratio[t], 1 - EPS_LOW), 1 + EPS_HIGH)
            unclipped_is_min = ratio[t] * adv[t] <= clipped * adv[t]
            loss += -min(ratio[t] * adv[t], clipped * adv[t])
            dlogp[t] = -adv[t] * ratio[t] if unclipped_is_min else 0.0
        else:  # proximal policy = the learner itself: ratio 1, weight min(pi/mu, cap) carries the correction
            w = min(ratio[t], tis_cap)
            loss += -adv[t] * w
            dlogp[t] = -adv[t] * w
    onehot = np.eye(vocab)[targets]
    grad = (dlogp / normalizer)[:, None] * (onehot - q) / temperature
    entropy = -(q * logq).sum(-1).mean()
    return loss / normalizer, grad, ratio, entropy


def test_loss_and_gradient_match_hand_reference_without_clipping():
    case = _case([0.05, -0.1, 0.0, 0.12, -0.03], [1.0, -0.5, 0.3, -1.2, 0.8])
    loss, grad, metrics = _torch_loss(*case, normalizer=7.0)
    ref_loss, ref_grad, ratio, entropy = _reference(*case, normalizer=7.0)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert metrics["ratio"] == pytest.approx(ratio.mean())
    assert metrics["ratio/std"] == pytest.approx(ratio.std())  # the per-token spread, population std
    assert metrics["entropy"] == pytest.approx(entropy)
    assert metrics["clip_ratio/region_mean"] == 0.0
    assert not any(k.startswith("sampling/importance_sampling_ratio") for k in metrics)  # no TIS, no weights


def test_clipping_zeroes_gradient_only_where_the_clipped_term_is_the_minimum():
    # token 0: ratio 1.5, A>0 -> clipped high (no gradient); token 1: ratio 0.5, A<0 -> clipped low (no gradient);
    # token 2: ratio 1.5, A<0 and token 3: ratio 0.5, A>0 -> the unclipped term is the min, the gradient flows.
    case = _case([math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5), 0.0], [1.0, -1.0, -1.0, 1.0, 0.5])
    loss, grad, metrics = _torch_loss(*case, normalizer=5.0)
    ref_loss, ref_grad, _, _ = _reference(*case, normalizer=5.0)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert np.abs(grad[0]).max() == 0.0 and np.abs(grad[1]).max() == 0.0
    assert np.abs(grad[2]).max() > 0 and np.abs(grad[3]).max() > 0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)


def test_the_ratio_spread_adds_up_over_micro_batches_and_is_zero_on_policy():
    from app.objectives.base import LossStats

    offsets = [0.3, -0.2, 0.0, 0.1, -0.4, 0.25]
    case = _case(offsets, [1.0] * 6)
    halves = LossStats()
    for part in (slice(0, 2), slice(2, 6)):  # two micro-batches, reduced as the learner reduces them
        logits, targets, sampling, adv, temperature = case
        logp, entropy = token_logprobs(torch.tensor(logits[part]), torch.tensor(targets[part]), temperature)
        streams = {SAMPLING_LOGPROBS: torch.tensor(sampling[part]), ADVANTAGES: torch.tensor(adv[part])}
        halves.add(GRPO(epsilon=EPS_LOW, epsilon_high=EPS_HIGH).loss(logp, entropy, streams, 6.0)[1])
    assert halves.metrics()["ratio/std"] == pytest.approx(np.exp(offsets).std())
    _, _, on_policy = _torch_loss(*_case([0.0] * 4, [1.0, -1.0, 0.5, 0.2]), normalizer=4.0)
    assert on_policy["ratio/std"] == pytest.approx(0.0, abs=1e-6)


def test_truncated_importance_sampling_matches_hand_reference():
    cap = 1.3
    case = _case([math.log(2.0), math.log(0.6), 0.1, math.log(1.25)], [1.0, -0.7, 0.4, -1.1])
    loss, grad, metrics = _torch_loss(*case, normalizer=4.0, tis_cap=cap)
    ref_loss, ref_grad, ratio, _ = _reference(*case, normalizer=4.0, tis_cap=cap)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    weights = np.minimum(ratio, cap)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(weights.mean())
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(cap)
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(weights.min())
    assert metrics["ratio"] == pytest.approx(ratio.mean())  # still the learner/sampler agreement
    assert metrics["clip_ratio/region_mean"] == 0.0  # with TIS the PPO ratio is 1: nothing to clip


def test_token_logprobs_are_taken_at_the_sampling_temperature():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    logp, entropy = token_logprobs(logits, torch.tensor([0]), temperature=0.5)
    q = torch.softmax(logits / 0.5, -1)
    assert logp.item() == pytest.approx(math.log(q[0, 0].item()), abs=1e-6)
    assert entropy.item() == pytest.approx(-(q * q.log()).sum().item(), abs=1e-6)
    assert token_logprobs(logits, torch.tensor([0]), temperature=1.0)[0].item() != pytest.approx(logp.item())


def test_unreported_sampling_logprob_counts_as_agreement():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    _, stats = grpo_loss(
        logp, torch.tensor([float("nan"), -2.0]), torch.tensor([1.0, 1.0]), 2.0, epsilon=EPS_LOW, epsilon_high=EPS_HIGH
    )
    assert stats.metrics()["ratio"] == pytest.approx(1.0)


def test_annotation_puts_each_samples_group_advantage_on_every_token():
    rewards = [1.0, 0.0, float("nan"), 1.0]
    samples = [Sample([5] * n, [-1.0] * n, r) for n, r in zip([3, 1, 2, 4], rewards, strict=True)]
    group = Group(0, "p", [1, 2], 0, samples)
    GRPO(epsilon=EPS_LOW, epsilon_high=EPS_HIGH).annotate(group)
    for sample, advantage in zip(group.samples, group_advantages(rewards), strict=True):
        assert sample.streams[ADVANTAGES] == [advantage] * len(sample.completion_ids)
