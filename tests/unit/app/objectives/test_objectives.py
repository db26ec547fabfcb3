"""The objectives layer: built from the run's config, annotating groups, a weighted sum of losses whose
statistics reduce over micro-batches and ranks. GRPO's own numbers are in test_grpo_loss.py."""

import math

import pytest
import torch

from app.objectives import LossStats, Objectives
from app.objectives.grpo import ADVANTAGES, GRPO
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample
from core.config import load_config


def test_the_default_is_grpo_alone_with_its_own_settings():
    (objective,) = Objectives.from_config(load_config(None)).objectives
    assert isinstance(objective, GRPO) and objective.weight == 1.0 and objective.tis_cap is None
    cfg = load_config(
        None, ["objectives=[{kind: grpo, vllm_importance_sampling_correction: true, epsilon_high: 0.28}]"]
    )
    cfg.objectives[0].weight = 0.5
    (objective,) = Objectives.from_config(cfg).objectives
    assert (objective.weight, objective.epsilon_high, objective.tis_cap) == (0.5, 0.28, 2.0)


def _streams(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_()
    sampling = logp.detach() + torch.randn(n, generator=g, dtype=torch.float64) * 0.1
    streams = {SAMPLING_LOGPROBS: sampling, ADVANTAGES: torch.randn(n, generator=g, dtype=torch.float64)}
    return logp, torch.rand(n, dtype=torch.float64), streams


def test_the_loss_is_the_weighted_sum_and_each_objective_counts_its_own_tokens():
    logp, entropy, streams = _streams()
    whole = Objectives([GRPO(1.0, epsilon=0.2, epsilon_high=0.2)])
    half = Objectives([GRPO(0.5, epsilon=0.2, epsilon_high=0.2)])
    assert whole.num_tokens([streams, streams]) == [12]
    loss, stats = whole.loss(logp, entropy, streams, [12.0])
    (grad,) = torch.autograd.grad(loss, logp)
    halved, halved_stats = half.loss(logp, entropy, streams, [12.0])
    (halved_grad,) = torch.autograd.grad(halved, logp)
    assert halved.item() == pytest.approx(loss.item() / 2) and torch.allclose(halved_grad, grad / 2)
    assert halved_stats == stats  # the weight scales the loss, never what the metrics report


def test_groups_that_no_objective_annotated_are_refused_by_name():
    objectives = Objectives.from_config(load_config(None))
    with pytest.raises(ValueError, match="no advantages stream: annotate them"):
        objectives.num_tokens([{SAMPLING_LOGPROBS: torch.zeros(3)}])
    group = Group(0, "p", [1], 0, [Sample([5, 6], [-1.0, -1.0], 1.0), Sample([7], [-1.0], 0.0)])
    assert objectives.annotate(group) is group and all(ADVANTAGES in s.streams for s in group.samples)


def test_loss_stats_add_reduce_and_report_means_and_reached_extremes():
    a = LossStats.over_tokens({"ratio": 3.0, "kl": 0.3}, 3.0, mins={"w/min": 0.5}, maxs={"w/max": 1.5})
    b = LossStats.over_tokens({"ratio": 1.0, "kl": 0.1}, 1.0, mins={"w/min": 0.9}, maxs={"w/max": 2.0})
    total = LossStats()
    total.add(a)
    total.add(b.emptied())  # a filler's: its names, nothing counted
    assert total.metrics() == pytest.approx({"ratio": 1.0, "kl": 0.1, "w/min": 0.5, "w/max": 1.5})
    total.add(b)
    assert total.metrics() == pytest.approx({"ratio": 1.0, "kl": 0.1, "w/min": 0.5, "w/max": 2.0})
    # What ranks all-reduce: every rank lays its names out in the same order, values survive the round trip.
    assert total.from_tensors(*total.as_tensors()) == total
    assert b.emptied().as_tensors()[0].tolist() == [0.0] * 4
    nothing = b.emptied()
    assert nothing.metrics() == {"ratio": 0.0, "kl": 0.0}  # no token reached an extreme: none reported
    assert math.isinf(nothing.mins["w/min"])
