"""The run's config by concern: every shipped config loads in the new form; the old `grpo` section is read for one
more release, each key moved with one line naming its new key; each section checks itself."""

from __future__ import annotations

import pytest
import yaml

from core.config import CONFIG_DIR, ConfigError, deprecated, load_config, load_fleet_config
from core.config.envs import EnvConfig
from core.config.run import JoinConfig, RunConfig

OLD_GRPO = {
    "num_generations": 4,
    "num_prompts_per_step": 8,
    "max_completion_length": 5,
    "temperature": 0.9,
    "top_p": 0.95,
    "learning_rate": 3.0e-4,
    "adam_beta2": 0.95,
    "max_grad_norm": 0.5,
    "warmup_steps": 3,
    "epsilon": 0.1,
    "epsilon_high": 0.28,
    "vllm_importance_sampling_correction": True,
    "max_staleness": 1,
    "weight_sync_steps": 2,
    "max_steps": 7,
    "seed": 5,
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(deprecated, "_warned", set())


def write(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_in_the_new_form(path, capsys):
    load = load_fleet_config if path.name.startswith("fleet-") else load_config
    load(path)
    assert "grpo:" not in path.read_text().splitlines()
    assert capsys.readouterr().err == ""


def test_an_old_grpo_section_loads_as_its_new_keys_with_one_line_each(tmp_path, capsys):
    old = load_config(write(tmp_path, {"grpo": OLD_GRPO}))
    err = capsys.readouterr().err.splitlines()
    new = RunConfig.model_validate(
        {
            "sampling": {"num_generations": 4, "max_completion_length": 5, "temperature": 0.9, "top_p": 0.95},
            "train": {
                "num_prompts_per_step": 8,
                "learning_rate": 3.0e-4,
                "adam_beta2": 0.95,
                "max_grad_norm": 0.5,
                "warmup_steps": 3,
                "max_steps": 7,
                "seed": 5,
            },
            "objectives": [
                {"kind": "grpo", "epsilon": 0.1, "epsilon_high": 0.28, "vllm_importance_sampling_correction": True}
            ],
            "rollout": {"max_staleness": 1},
            "learner": {"weight_sync_steps": 2},
        }
    )
    assert old.model_dump() == new.model_dump()
    assert len(err) == len(OLD_GRPO) and all(line.startswith("deprecated: grpo.") for line in err)
    assert "deprecated: grpo.max_steps is now train.max_steps (grpo is read for one more release)" in err
    assert any(
        "grpo.epsilon_high is now the grpo objective's: objectives: [{kind: grpo, epsilon_high" in e for e in err
    )
    load_config(write(tmp_path, {"grpo": OLD_GRPO}))
    assert capsys.readouterr().err == ""  # once per process


def test_set_takes_old_and_new_keys_and_the_later_one_wins(tmp_path, capsys):
    cfg = load_config(None, ["grpo.max_steps=9", "grpo.temperature=0.7", "grpo.epsilon_high=0.3"])
    assert (cfg.train.max_steps, cfg.sampling.temperature, cfg.objectives[0].epsilon_high) == (9, 0.7, 0.3)
    assert "deprecated: grpo.temperature is now sampling.temperature" in capsys.readouterr().err
    assert load_config(None, ["train.max_steps=9"]).train.max_steps == 9
    # An old file with a new --set, and a new file with an old --set: the override wins either way.
    old_file = write(tmp_path, {"grpo": {"max_steps": 150, "epsilon": 0.2}})
    assert load_config(old_file, ["train.max_steps=5"]).train.max_steps == 5
    cfg = load_config(CONFIG_DIR / "tiny-cpu.yaml", ["grpo.max_steps=5", "grpo.epsilon=0.15"])
    assert (cfg.train.max_steps, cfg.objectives[0].epsilon) == (5, 0.15)


def test_an_old_grpo_setting_a_run_without_grpo_never_read_is_ignored_with_one_line(capsys):
    distill_only = ["objectives=[{kind: distill, teacher: base}]", "grpo.epsilon=0.1"]
    cfg = load_config(CONFIG_DIR / "tiny-distill.yaml", distill_only)
    assert [o.kind for o in cfg.objectives] == ["distill"]
    assert "deprecated: grpo.epsilon is ignored: the run has no grpo objective" in capsys.readouterr().err


def test_a_key_grpo_never_had_is_one_line():
    with pytest.raises(ConfigError, match=r"^grpo.max_stepz: unknown key$"):
        load_config(None, ["grpo.max_stepz=3"])


def test_each_section_checks_itself():
    with pytest.raises(ValueError, match="one environment, not several"):
        EnvConfig(name="calculator", factory="m:f")
    assert EnvConfig(factory="m:f").kind == "factory" and EnvConfig().kind is None
    with pytest.raises(ValueError, match="expected an http:// or https:// URL"):
        JoinConfig(url="ftp://x")
    with pytest.raises(ConfigError, match=r"^task: name math needs task.dataset$"):
        load_config(None, ["task.name=math"])
    with pytest.raises(ConfigError, match=r"^objectives: each kind at most once"):
        load_config(None, ["objectives=[{kind: grpo}, {kind: grpo}]"])
    with pytest.raises(ConfigError, match="sampling.max_completion_length must be smaller than model.max_model_len"):
        load_config(None, ["sampling.max_completion_length=64"])
    assert set(RunConfig.model_fields) >= {"train", "sampling", "objectives"} and "grpo" not in RunConfig.model_fields
