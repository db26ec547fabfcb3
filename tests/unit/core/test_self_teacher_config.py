"""The self teacher's config (`teacher: {self: {...}}`): what it accepts and what it refuses, in the run's config."""

import pytest

from core.config import ConfigError, load_config
from core.config.teacher import TeacherConfig
from tiny.folder import tiny_model_folder

SELF = "objectives=[{kind: distill, teacher: {self: {model: %s, context: '%s'}}}]"


def test_a_self_teacher_is_a_kind_with_a_context():
    cfg = load_config(None, [SELF % ("live", "Hint: {answer} {prompt}")])
    assert cfg.teacher.kind == "self" and cfg.teacher.context == "Hint: {answer} {prompt}"
    assert cfg.teacher.self_teacher.model == "live"
    assert TeacherConfig.model_validate("base").context is None
    # What it dumps reads back (a config travels to Ray's actors as itself, and to trackio dumped).
    again = TeacherConfig.model_validate(cfg.teacher.model_dump(by_alias=True))
    assert again == cfg.teacher


@pytest.mark.parametrize(
    ("override", "why"),
    [
        (SELF % ("live", "{answer}"), "must show the student's prompt"),
        (SELF % ("best", "{answer} {prompt}"), "self.model"),
        (
            "objectives=[{kind: distill, teacher: {url: 'http://x', self: {model: base, context: '{answer}{prompt}'}}}]",
            "name one of adapter, model, url, self, not url and self",
        ),
    ],
)
def test_a_bad_self_teacher_is_a_config_error(override, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, [override])


def test_a_shared_fleets_run_may_have_a_self_teacher():
    cfg = load_config(None, [SELF % ("live", "{answer} {prompt}"), "join.url=http://127.0.0.1:8000"])
    assert cfg.teacher.kind == "self"


def test_the_warm_up_context_changes_the_tiny_models_key_and_only_it():
    plain = load_config("configs/tiny-cpu.yaml", [])
    assert tiny_model_folder(plain.model, plain.task).name == "tiny-qwen2-50ba3e926688a80c"  # the default's cache
    shown = load_config("configs/tiny-cpu.yaml", ["model.tiny.warmup_context='Hint: {answer} {prompt}'"])
    assert tiny_model_folder(shown.model, shown.task) != tiny_model_folder(plain.model, plain.task)
    with pytest.raises(ConfigError, match="must show the student's prompt"):
        load_config("configs/tiny-cpu.yaml", ["model.tiny.warmup_context='{answer}'"])


EMA = "objectives=[{kind: distill, teacher: {self: {model: ema, context: '{answer} {prompt}'%s}}}]"


def test_an_ema_teacher_takes_trls_update_rate_and_sync_steps_and_a_second_lineages_slots():
    cfg = load_config(None, [EMA % ", update_rate: 0.1, sync_steps: 4"])
    spec = cfg.teacher.self_teacher
    assert (spec.model, spec.update_rate, spec.sync_steps) == ("ema", 0.1, 4)
    assert cfg.ema_teachers == [spec] and cfg.lineages == 2
    plain = load_config(None, [SELF % ("live", "{answer} {prompt}")])
    assert plain.lineages == 1 and plain.ema_teachers == []
    w = cfg.rollout.max_staleness + 1
    assert cfg.own_fleet_sizes()["max_loras"] == 2 * w + 1 == plain.own_fleet_sizes()["max_loras"] + w
    assert load_config(None, [EMA % ""]).teacher.self_teacher.update_rate == 0.05  # TRL's defaults
    again = TeacherConfig.model_validate(cfg.teacher.model_dump(by_alias=True))
    assert again == cfg.teacher
    assert TeacherConfig.model_validate(plain.teacher.model_dump(by_alias=True)) == plain.teacher  # live's dump too


@pytest.mark.parametrize(
    ("override", "why"),
    [
        (EMA % ", update_rate: 0", "update_rate"),
        (EMA % ", update_rate: 1.5", "update_rate"),
        (EMA % ", sync_steps: 0", "sync_steps"),
        (
            "objectives=[{kind: distill, teacher: {self: {model: live, context: '{answer} {prompt}', update_rate: 0.2}}}]",
            "update_rate=0.2 set the average of an ema teacher; this one is live",
        ),
        (EMA % "", "fleet.max_loras=3: an ema teacher's lineage pins a window beside the policy's"),
    ],
)
def test_a_bad_ema_teacher_is_a_config_error(override, why):
    extra = ["fleet.max_loras=3", "rollout.max_staleness=1"] if "max_loras" in why else []
    with pytest.raises(ConfigError, match=why):
        load_config(None, [override, *extra])
