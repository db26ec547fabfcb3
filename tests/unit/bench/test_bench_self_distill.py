"""bench/self_distill.py's pure parts: TRL's teacher prompt and settings from the shipped config, the summary, the table."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from bench import self_distill  # noqa: E402
from core.config import load_config  # noqa: E402


def test_trl_template_renders_the_teacher_prompt_spotrl_renders():
    from app.tasks.privileged import privileged_prompt
    from app.tasks.problems import Problem

    context = "Hint: {answer}\n{prompt}"
    template = self_distill.trl_template(context)
    problem = Problem(id="p0", prompt="Q: 12+30=? A:", answer="42")
    assert template.format(prompt=problem.prompt, privileged_context=problem.answer) == privileged_prompt(
        context, problem
    )
    with pytest.raises(SystemExit):
        self_distill.trl_template("Solution: {solution}\n{prompt}")


def test_trl_settings_follow_the_shipped_config(tmp_path):
    cfg = load_config(self_distill.CONFIG)
    args = self_distill.trl_args(cfg, tmp_path, 10)
    assert args.teacher_model_kind == "base" and args.distillation_mode == "sampled_token"
    assert args.distillation_alpha == 1.0 and not args.use_vllm
    assert args.teacher_prompt_template == "Hint: {privileged_context}\n{prompt}"
    # 16 prompts x 8 samples in one optimizer step, generated once per step, as spotrl's step
    assert args.generation_batch_size == 128 and args.steps_per_generation == 1 and args.num_generations == 8
    assert args.learning_rate == cfg.train.learning_rate and args.lr_scheduler_type == "constant"
    assert args.max_completion_length == 6 and args.temperature == 1.0 and args.top_k == 0


def test_arm_config_grpo_keeps_only_the_reward(tmp_path):
    grpo = self_distill.arm_config("grpo", tmp_path, 20, 18000)
    spotrl = self_distill.arm_config("spotrl", tmp_path, 20, 18000)
    assert [o.kind for o in grpo.objectives] == ["grpo"]
    assert [o.kind for o in spotrl.objectives] == ["distill"]
    assert grpo.train.max_steps == spotrl.train.max_steps == 20 and grpo.model == spotrl.model


def test_ratios_and_table():
    def arm(accuracies, walls):
        points = {
            10 * (i + 1): {"accuracy": a, "wall_s": w, "samples": 1280 * (i + 1)}
            for i, (a, w) in enumerate(zip(accuracies, walls, strict=True))
        }
        return {"points": self_distill.checkpoint_rows(points, 0.1)}

    arms = {"spotrl": arm([0.3, 0.5], [10, 20]), "trl": arm([0.2, 0.5], [30, 40]), "grpo": arm([0.2, 0.3], [9, 18])}
    arms["spotrl"] |= {"reverse_kl_start": 0.6, "reverse_kl_end": 0.3}
    summary = self_distill.ratios(arms)
    assert summary["per_step"][0]["trl_wall_over_spotrl"] == 3.0
    assert summary["median_spotrl_minus_trl"] == pytest.approx(0.05)
    assert summary["median_spotrl_minus_grpo"] == pytest.approx(0.15)
    assert summary["median_trl_wall_over_spotrl"] == pytest.approx(2.5)
    rows = self_distill.table_rows(arms)
    assert rows[0] == ["step 10 (1280 samples)", "0.300 @ 10 s", "0.200 @ 30 s", "0.200 @ 9 s"]
    assert rows[-1][1] == "0.600 -> 0.300"


def test_step_phases_are_medians_over_the_steps_and_the_teacher_is_per_group(tmp_path):
    import json

    lines = [
        {"perf/rollout_wait_s": w, "perf/step_s": 0.2, "perf/weight_sync_s": 0.03, "batch/groups": 16.0, **extra}
        for w, extra in [(1.0, {"distill/teacher_s": 8.0}), (3.0, {"distill/teacher_s": 4.0}), (2.0, {})]
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    phases = self_distill.step_phases(tmp_path)
    assert phases == {
        "rollout_wait_s": 2.0,
        "learner_step_s": 0.2,
        "weight_sync_s": 0.03,
        "teacher_s_per_group": 0.375,  # 8/16 and 4/16; a step without a teacher is not one
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[2]) + "\n")
    assert self_distill.step_phases(tmp_path)["teacher_s_per_group"] is None
