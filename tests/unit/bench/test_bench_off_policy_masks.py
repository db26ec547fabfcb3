"""bench.off_policy_masks's reading of a run: what the guards did per step, as medians and maxima."""

from bench.off_policy_masks import ARMS, step_figures
from core.config import load_config


def test_the_guards_figures_are_medians_and_maxima_over_the_steps_and_an_unlogged_guard_is_left_out():
    steps = [
        {"step": 1, "ratio/std": 0.1, "off_policy/masked_share": 0.0},
        {"step": 2, "ratio/std": 0.3, "off_policy/masked_share": 0.2},
        {"step": 3, "ratio/std": 0.2, "off_policy/masked_share": 0.5},
    ]
    figures = step_figures(steps)
    assert figures == {
        "ratio_std_median": 0.2,
        "ratio_std_max": 0.3,
        "masked_share_median": 0.2,
        "masked_share_max": 0.5,
    }


def test_each_arm_is_the_embedded_defaults_objective_with_its_guards():
    guards = {}
    for name, objective in ARMS.items():
        (grpo,) = load_config("configs/tiny-cpu.yaml", [objective]).objectives
        assert (grpo.kind, grpo.epsilon, grpo.epsilon_high) == ("grpo", 0.2, 0.2)
        guards[name] = (grpo.vllm_importance_sampling_correction, grpo.sequence_is, grpo.token_mask)
    assert guards == {
        "tis": (True, "off", False),
        "tis + masks": (True, "mask", True),
        "truncation + token mask": (False, "truncate", True),
    }
