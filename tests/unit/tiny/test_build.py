"""What the entry points get from the build: a run's model and its tiny teacher named by the folders built for the
run's task (the teacher's in the config, which its deployment loads as named); a fleet's tiny, which names no task,
the embedded default's; and no tiny folder resolved below the build."""

import pytest

import tiny.build as build
from core.config import CONFIG_DIR, ConfigError, load_config, load_fleet_config
from core.models import resolve_model_path
from tiny.folder import tiny_model_folder


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Each build recorded (its warm-up target, its task) and given a folder of its own, nothing trained."""
    builds = []

    def ensure(model_cfg, task_cfg, log=print):
        builds.append((model_cfg.tiny.warmup_target_accuracy, task_cfg))
        return tmp_path / f"tiny-{len(builds)}", {}

    monkeypatch.setattr(build, "ensure_tiny_model", ensure)
    return builds, tmp_path


def test_a_run_names_its_tiny_teacher_by_the_folder_built_for_its_task(built):
    builds, folders = built
    cfg = load_config(CONFIG_DIR / "tiny-distill.yaml")
    assert build.prepare_run(cfg) == str(folders / "tiny-1")
    assert [(target, task) for target, task in builds] == [(0.45, cfg.task), (0.85, cfg.task)]
    assert cfg.own_fleet().teacher.model.name_or_path == str(folders / "tiny-2")
    assert resolve_model_path(cfg.teacher_of("model").model) == str(folders / "tiny-2")
    assert cfg.model.name_or_path == "tiny"  # the base model keeps its name, which the fleet serves it under too


def test_a_fleets_tiny_is_the_embedded_defaults_and_a_folder_is_served_as_named(built):
    builds, folders = built
    fleet = load_fleet_config()
    assert build.prepare_model(fleet.model) == str(folders / "tiny-1") and builds[0][1] == build.EMBEDDED_TASK
    default = load_config(CONFIG_DIR / "tiny-cpu.yaml")  # `make serve` serves `make train`'s model
    assert tiny_model_folder(fleet.model, build.EMBEDDED_TASK) == tiny_model_folder(default.model, default.task)
    named = load_fleet_config(None, [f"model.name_or_path={folders}/tiny-7"]).model
    assert build.prepare_model(named) == f"{folders}/tiny-7" and len(builds) == 1


def test_no_tiny_folder_is_resolved_below_the_build():
    with pytest.raises(ConfigError, match="^model.name_or_path: tiny is built by the entry point"):
        resolve_model_path(load_config(None, []).model)


def test_a_config_error_the_build_finds_is_one_line_and_exit_2(capsys):
    """`python -m tiny` (`make tiny-model`): a demo's recipe that cannot take the task is found by the build, not
    the schema, and is said as every entry point says a config error."""
    from tiny.build import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(CONFIG_DIR / "tiny-trl-tools.yaml"), "--set", "task.name=chained_arithmetic"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "config error: model.tiny.warmup_tools: the tool warm-up demonstrates additions (task.name: arithmetic)"
    ]
