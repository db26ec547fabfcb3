"""The off-policy guards beyond TIS on toy tensors: which tokens and samples each drops or caps, and its counts."""

import math

import pytest
import torch

from app.objectives.base import SAMPLE_INDEX, LossStats
from app.objectives.grpo import GRPO, grpo_loss
from app.objectives.off_policy import (
    MASKED_SEQUENCES,
    MASKED_SHARE,
    MASKED_TOKENS,
    SEQUENCE_RATIO,
    TRUNCATED_SEQUENCES,
    OffPolicyMasks,
    off_policy_weights,
)
from contracts.rollouts import SAMPLING_LOGPROBS

# Three samples of 2, 3 and 1 tokens; per-token learner/sampler ratios chosen around the band [0.5, 2].
RATIOS = [1.0, 3.0, 0.9, 1.1, 0.2, 1.5]
SAMPLES = [0, 0, 1, 1, 1, 2]
# Sequence ratios: 1 x 3 = 3 (above), 0.9 x 1.1 x 0.2 = 0.198 (below), 1.5 (inside).
SEQUENCE_RATIOS = [3.0, 0.9 * 1.1 * 0.2, 1.5]


def _toy():
    sampling = torch.full((6,), -1.0, dtype=torch.float64)
    logp = (sampling + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 0.5], dtype=torch.float64)
    return logp, sampling, advantages, torch.tensor(SAMPLES, dtype=torch.float32)


def test_the_token_mask_drops_tokens_outside_the_band_and_counts_them():
    logp, sampling, _, _ = _toy()
    weights = off_policy_weights(logp - sampling, None, OffPolicyMasks(token_mask=True))
    assert weights.factor.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    metrics = weights.stats.metrics()
    assert metrics[MASKED_TOKENS] == 2
    assert metrics[MASKED_SHARE] == pytest.approx(2 / 6)


def test_the_sequence_mask_drops_whole_samples_outside_the_band_and_counts_them():
    logp, sampling, _, index = _toy()
    weights = off_policy_weights(logp - sampling, index, OffPolicyMasks(sequence="mask"))
    assert weights.factor.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    metrics = weights.stats.metrics()
    assert metrics[MASKED_SEQUENCES] == 2
    assert metrics[MASKED_SHARE] == pytest.approx(5 / 6)
    assert metrics[SEQUENCE_RATIO] == pytest.approx(sum(SEQUENCE_RATIOS) / 3)
    assert metrics[f"{SEQUENCE_RATIO}/min"] == pytest.approx(min(SEQUENCE_RATIOS))
    assert metrics[f"{SEQUENCE_RATIO}/max"] == pytest.approx(3.0)


def test_sequence_truncation_caps_each_samples_ratio_into_the_band_and_counts_the_capped():
    logp, sampling, _, index = _toy()
    weights = off_policy_weights(logp - sampling, index, OffPolicyMasks(sequence="truncate"))
    torch.testing.assert_close(weights.factor, torch.tensor([2.0, 2.0, 0.5, 0.5, 0.5, 1.5], dtype=torch.float64))
    metrics = weights.stats.metrics()
    assert metrics[TRUNCATED_SEQUENCES] == 2
    assert metrics[MASKED_SHARE] == 0


def test_a_band_wide_enough_changes_nothing():
    logp, sampling, advantages, index = _toy()
    wide = OffPolicyMasks(
        sequence="mask", sequence_low=0.01, sequence_high=100, token_mask=True, token_low=0.1, token_high=10
    )
    plain, _ = grpo_loss(logp, sampling, advantages, 6.0, epsilon=0.2, epsilon_high=0.2)
    guarded, stats = grpo_loss(
        logp, sampling, advantages, 6.0, epsilon=0.2, epsilon_high=0.2, masks=wide, sample_index=index
    )
    torch.testing.assert_close(guarded, plain)
    assert stats.metrics()[MASKED_SHARE] == 0


def test_masked_tokens_get_no_gradient_and_the_normaliser_is_unchanged():
    logp, sampling, advantages, index = _toy()
    masks = OffPolicyMasks(token_mask=True)
    loss, _ = grpo_loss(logp, sampling, advantages, 6.0, epsilon=10.0, epsilon_high=10.0, masks=masks)
    loss.backward()
    grad = logp.grad.tolist()
    assert grad[1] == 0 and grad[4] == 0
    # An unclipped kept token's gradient is -A * ratio / normaliser, as without the mask.
    assert grad[0] == pytest.approx(-1.0 * 1.0 / 6.0)
    assert grad[5] == pytest.approx(-0.5 * 1.5 / 6.0)


def test_sequence_truncation_takes_the_learner_as_proximal_and_weighs_by_the_capped_sequence_ratio():
    logp, sampling, advantages, index = _toy()
    masks = OffPolicyMasks(sequence="truncate")
    loss, stats = grpo_loss(
        logp, sampling, advantages, 6.0, epsilon=0.2, epsilon_high=0.2, masks=masks, sample_index=index
    )
    factor = [2.0, 2.0, 0.5, 0.5, 0.5, 1.5]
    # The PPO ratio is exactly 1 (no clip): each token's loss is -A x its sample's capped ratio.
    expected = -sum(a * f for a, f in zip(advantages.tolist(), factor, strict=True)) / 6.0
    assert loss.item() == pytest.approx(expected)
    assert stats.metrics()["clip_ratio/region_mean"] == 0
    assert stats.metrics()["ratio"] == pytest.approx(sum(RATIOS) / 6)  # the metric still reads the sampler's ratio
    with pytest.raises(ValueError, match="not with TIS"):
        grpo_loss(logp, sampling, advantages, 6.0, epsilon=0.2, epsilon_high=0.2, tis_cap=2.0, masks=masks)


def test_the_counts_add_up_over_micro_batches_as_totals_and_shares():
    logp, sampling, _, index = _toy()
    masks = OffPolicyMasks(sequence="mask", token_mask=True)
    halves = LossStats()
    for part in (slice(0, 2), slice(2, 6)):  # samples are never split over micro-batches
        halves.add(off_policy_weights((logp - sampling)[part], index[part], masks).stats)
    whole = off_policy_weights(logp - sampling, index, masks).stats.metrics()
    metrics = halves.metrics()
    assert metrics[MASKED_TOKENS] == whole[MASKED_TOKENS] == 2
    assert metrics[MASKED_SEQUENCES] == whole[MASKED_SEQUENCES] == 2
    assert metrics[MASKED_SHARE] == pytest.approx(whole[MASKED_SHARE]) == pytest.approx(5 / 6)


def test_the_sequence_guard_needs_the_sample_of_each_token():
    logp, sampling, _, _ = _toy()
    with pytest.raises(ValueError, match="SAMPLE_INDEX"):
        off_policy_weights(logp - sampling, None, OffPolicyMasks(sequence="mask"))


def test_the_objective_reads_its_guards_from_the_config_and_the_sample_index_from_the_streams():
    from core.config.objectives import GRPOObjectiveConfig

    spec = GRPOObjectiveConfig(kind="grpo", sequence_is="mask", token_mask=True, token_mask_high=5.0)
    objective = GRPO.from_config(spec, None)
    assert objective.masks == OffPolicyMasks(sequence="mask", token_mask=True, token_high=5.0)
    assert GRPO.from_config(GRPOObjectiveConfig(kind="grpo"), None).masks is None  # off by default
    logp, sampling, advantages, index = _toy()
    streams = {SAMPLING_LOGPROBS: sampling, "advantages": advantages, SAMPLE_INDEX: index}
    _, stats = objective.loss(logp, torch.zeros(6, dtype=torch.float64), streams, 6.0)
    assert stats.metrics()[MASKED_SEQUENCES] == 2


def test_the_config_refuses_empty_bands_and_two_corrections():
    from pydantic import ValidationError

    from core.config.objectives import GRPOObjectiveConfig

    with pytest.raises(ValidationError, match="token_mask_low must be below token_mask_high"):
        GRPOObjectiveConfig(kind="grpo", token_mask=True, token_mask_low=2.0, token_mask_high=1.0)
    with pytest.raises(ValidationError, match="choose one"):
        GRPOObjectiveConfig(kind="grpo", sequence_is="truncate", vllm_importance_sampling_correction=True)
    fields = GRPOObjectiveConfig.model_fields
    for name in ("sequence_is", "sequence_is_low", "sequence_is_high", "token_mask", "token_mask_low"):
        assert fields[name].description


def test_packing_gives_every_target_its_samples_index():
    from app.learner.packing import TrainSample, pack

    samples = [TrainSample([1, 2], [3, 4, 5], {"s": [0.0] * 3}, (0, 0)), TrainSample([1], [6], {"s": [0.0]}, (0, 1))]
    (mb,) = pack(samples, 64, 0)
    assert mb.streams[SAMPLE_INDEX].tolist() == mb.target_sample.float().tolist()
    assert sorted(set(mb.streams[SAMPLE_INDEX].tolist())) == [0.0, 1.0]
    assert math.isclose(mb.streams[SAMPLE_INDEX].numel(), 4)
