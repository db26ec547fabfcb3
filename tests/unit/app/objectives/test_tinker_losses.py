"""The Tinker SDK's built-in losses, each against its documented formula computed by hand, and their input checks."""

import math

import pytest
import torch

from app.objectives.tinker_losses import LossInputError, check_inputs, check_loss, datum_loss

TARGET = torch.tensor([-0.5, -1.0, -2.0])
SAMPLING = torch.tensor([-0.6, -0.5, -2.0])
ADV = torch.tensor([1.0, -1.0, 2.0])


def loss(name, target=TARGET, **config):
    inputs = {"weights": torch.tensor([0.0, 1.0, 0.5]), "logprobs": SAMPLING, "advantages": ADV}
    return datum_loss(name, target, inputs, check_loss(name, config)).item()


def test_cross_entropy_is_the_weighted_negative_log_likelihood_summed():
    assert loss("cross_entropy") == pytest.approx(1.0 * 1.0 + 0.5 * 2.0)


def test_importance_sampling_weighs_advantages_by_the_ratio():
    ratios = [math.exp(t - s) for t, s in zip(TARGET.tolist(), SAMPLING.tolist(), strict=True)]
    assert loss("importance_sampling") == pytest.approx(-sum(r * a for r, a in zip(ratios, ADV.tolist(), strict=True)))


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_terms():
    def by_hand(low, high):
        total = 0.0
        for t, s, a in zip(TARGET.tolist(), SAMPLING.tolist(), ADV.tolist(), strict=True):
            r = math.exp(t - s)
            total += min(r * a, min(max(r, low), high) * a)
        return -total

    assert loss("ppo") == pytest.approx(by_hand(0.8, 1.2))
    assert loss("ppo", clip_low_threshold=0.9, clip_high_threshold=1.05) == pytest.approx(by_hand(0.9, 1.05))


def test_cispo_gradient_is_the_clipped_ratio_times_the_advantage():
    target = TARGET.clone().requires_grad_(True)
    inputs = {"logprobs": SAMPLING, "advantages": ADV}
    datum_loss("cispo", target, inputs, check_loss("cispo", {})).backward()
    clipped = [min(max(math.exp(t - s), 0.8), 1.2) for t, s in zip(TARGET.tolist(), SAMPLING.tolist(), strict=True)]
    assert target.grad.tolist() == pytest.approx([-c * a for c, a in zip(clipped, ADV.tolist(), strict=True)])


def test_dro_penalises_the_squared_log_ratio():
    beta = 0.1
    by_hand = -sum(
        t * a - 0.5 * beta * (t - s) ** 2
        for t, s, a in zip(TARGET.tolist(), SAMPLING.tolist(), ADV.tolist(), strict=True)
    )
    assert loss("dro", beta=beta) == pytest.approx(by_hand)


def test_gspo_gives_every_token_the_sequence_ratio_over_the_masked_tokens_and_its_own_gradient():
    """GSPO-token as Tinker's losses page gives it: the first two tokens' log-ratios (0.1 and -0.5) set the sequence
    ratio exp(-0.2), the unmasked third does not; each token's loss term is ppo's on that ratio, and its gradient is
    the ratio times its advantage (inside the clip band) or nothing (outside it, on the side the advantage pushes)."""
    mask = torch.tensor([1.0, 1.0, 0.0])
    target = TARGET.clone().requires_grad_(True)
    inputs = {"logprobs": SAMPLING, "advantages": ADV, "sequence_ratio_mask": mask}
    datum_loss("gspo", target, inputs, check_loss("gspo", {})).backward()
    s = math.exp(((-0.5 + 0.6) + (-1.0 + 0.5)) / 2)  # 0.819: inside [0.8, 1.2]
    assert target.grad.tolist() == pytest.approx([-s * a for a in ADV.tolist()])
    narrow = check_loss("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    target.grad = None
    value = datum_loss("gspo", target, inputs, narrow)
    value.backward()
    # s < 0.9: a positive advantage keeps min(s * A, 0.9 * A) = s * A and its gradient, a negative one the clipped
    # constant and none
    assert target.grad.tolist() == pytest.approx([-s * 1.0, 0.0, -s * 2.0])
    assert value.item() == pytest.approx(-(s * 1.0 + 0.9 * -1.0 + s * 2.0))
    unchanged = {"logprobs": TARGET, "advantages": ADV, "sequence_ratio_mask": mask}
    assert datum_loss("gspo", TARGET, unchanged, check_loss("gspo", {})).item() == pytest.approx(-ADV.sum().item())
    with pytest.raises(LossInputError, match="marks no token"):
        check_inputs("gspo", 3, {"logprobs": [0] * 3, "advantages": [0] * 3, "sequence_ratio_mask": [0.0] * 3})


def test_unknown_losses_keys_and_missing_inputs_are_refused_by_name():
    with pytest.raises(LossInputError, match="supported"):
        check_loss("custom", {})
    with pytest.raises(LossInputError, match="unknown keys"):
        check_loss("ppo", {"epsilon": 0.1})
    with pytest.raises(LossInputError, match="advantages"):
        check_inputs("importance_sampling", 3, {"logprobs": [0, 0, 0]})
    with pytest.raises(LossInputError, match="2 values for 3"):
        check_inputs("cross_entropy", 3, {"weights": [1, 1]})
