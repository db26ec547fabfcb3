"""The objective recipe (`examples/objective_rloo.py`): its advantages and loss against the formula on toy tensors,
the config naming it, and the run's objectives (as the rollout and the learner build them) annotating with it and
summing its loss."""

import math

import pytest
import torch

from app.objectives import Objectives
from app.objectives.combined import KINDS, register_objective
from app.objectives.grpo import GRPO
from contracts.rollouts import SAMPLING_LOGPROBS, Group, Sample
from core.config import ConfigError
from examples.objective_rloo import ADVANTAGES, RLOO, Config, RLOORunConfig, leave_one_out, main, rloo_loss, run_config


def test_each_advantage_is_its_reward_less_the_mean_of_the_rest_of_its_group():
    assert leave_one_out([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert leave_one_out([1.0, math.nan, 0.0]) == pytest.approx([1.0, 0.0, -1.0])  # unscored: 0, nobody's baseline
    assert leave_one_out([1.0, math.nan]) == [0.0, 0.0]  # one scored sample has no baseline


def test_the_loss_is_minus_the_capped_weight_times_advantage_times_logp_over_the_steps_tokens():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([-1.0, -3.0, math.nan], dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, stats = rloo_loss(logp, sampling, advantages, normalizer=6.0, is_cap=2.0)
    weight = [1.0, 2.0, 1.0]  # exp(0); exp(1) capped at 2; a NaN sampling log-prob counts as agreement
    expected = -sum(w * a * lp for w, a, lp in zip(weight, [1.0, -0.5, 2.0], [-1.0, -2.0, -0.5], strict=True)) / 6
    assert loss.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, logp)  # no gradient through the weight: d/dlogp = -w x A / normalizer
    assert grad.tolist() == pytest.approx([-1 / 6, 1 / 6, -2 / 6])
    assert stats.metrics() == pytest.approx({"rloo/is_weight": 4 / 3, "rloo/advantage": 2.5 / 3})


def test_the_run_config_names_it_and_the_runs_objectives_annotate_and_sum_it():
    cfg = run_config(Config(steps=2, is_cap=1.5))
    assert isinstance(cfg, RLOORunConfig) and cfg.objectives[0].kind == "rloo"
    assert type(cfg).model_validate(cfg.model_dump()) == cfg  # the config travels to the workers as it is
    objectives = Objectives.from_config(cfg)  # what the rollout and each learner rank build
    (rloo,) = objectives.objectives
    assert isinstance(rloo, RLOO) and rloo.is_cap == 1.5
    group = Group(0, "p", [1], 0, [Sample([5, 6], [-1.0, -1.0], 1.0), Sample([7], [-1.0], 0.0)])
    objectives.annotate(group)
    assert [s.streams[ADVANTAGES] for s in group.samples] == [[1.0, 1.0], [-1.0]]
    streams = {SAMPLING_LOGPROBS: torch.tensor([-1.0, -1.0, -1.0]), ADVANTAGES: torch.tensor([1.0, 1.0, -1.0])}
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    assert objectives.num_tokens([streams]) == [3]
    loss, _ = objectives.loss(logp, torch.zeros(3), streams, [3.0])
    assert loss.item() == pytest.approx(1 / 3)


def test_it_sits_beside_grpo_and_the_config_refuses_it_twice():
    both = [{"kind": "grpo"}, {"kind": "rloo", "weight": 0.5}]
    cfg = RLOORunConfig.model_validate(run_config(Config()).model_dump() | {"objectives": both})
    grpo, rloo = Objectives.from_config(cfg).objectives
    assert isinstance(grpo, GRPO) and isinstance(rloo, RLOO) and rloo.weight == 0.5
    with pytest.raises(ValueError, match="each kind at most once"):
        RLOORunConfig.model_validate(cfg.model_dump() | {"objectives": [{"kind": "rloo"}, {"kind": "rloo"}]})


def test_the_registry_refuses_another_class_under_a_taken_kind():
    class Impostor(RLOO):
        kind = "grpo"

    with pytest.raises(ValueError, match="kind 'grpo' is already GRPO's"):
        register_objective(Impostor)
    assert register_objective(RLOO) is KINDS["rloo"]


def test_its_main_refuses_a_bad_config_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["sets=['task.reward_funcs=[nowhere:nothing]']"])
    assert exit.value.code == 2 and "config error: task.reward_funcs[0]" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train.max_steps"):
        run_config(Config(sets=["train.max_steps=0"]))
