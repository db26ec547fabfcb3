"""`logging.report_to` (`core.config.trackers`): the trackers a run names, checked at its config: a tracker the
machine lacks stops the run there, naming the extra that brings it; the old `logging.trackio` switch still reads."""

import pytest

from core.config import ConfigError, load_config
from core.config import trackers as trackers_module


def report_to(*sets: str) -> list[str]:
    return load_config(None, list(sets)).logging.report_to


def test_by_default_metrics_go_to_jsonl_trackio_and_the_ray_dashboard():
    assert report_to() == ["jsonl", "trackio", "ray"]


def test_tensorboard_and_wandb_are_named_beside_jsonl_once_each():
    assert report_to("logging.report_to=[jsonl, tensorboard, wandb, wandb]") == ["jsonl", "tensorboard", "wandb"]


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("[tensorboard]", "logging.report_to: jsonl is always written"),
        ("[jsonl, mlflow]", "logging.report_to.1: Input should be 'jsonl', 'trackio', 'ray', 'tensorboard' or 'wandb'"),
    ],
)
def test_a_run_without_jsonl_or_with_an_unknown_tracker_is_a_config_error(value, line):
    with pytest.raises(ConfigError, match=f"^{line}"):
        report_to(f"logging.report_to={value}")


def test_a_tracker_not_installed_is_a_config_error_naming_the_extra(monkeypatch):
    missing = {"wandb"}
    real = trackers_module.importlib.util.find_spec
    monkeypatch.setattr(
        trackers_module.importlib.util, "find_spec", lambda name: None if name in missing else real(name)
    )
    with pytest.raises(ConfigError, match=r"wandb not installed: pip install -e '\.\[trackers\]'"):
        report_to("logging.report_to=[jsonl, tensorboard, wandb]")
    assert report_to("logging.report_to=[jsonl, tensorboard]") == ["jsonl", "tensorboard"]


def test_the_old_trackio_switch_reads_as_report_to_with_one_deprecation_line(capsys, monkeypatch):
    monkeypatch.setattr(trackers_module, "_warned", False)
    assert report_to("logging.trackio=false") == ["jsonl", "ray"]
    assert report_to("logging.report_to=[jsonl, wandb]", "logging.trackio=true") == ["jsonl", "wandb", "trackio"]
    assert capsys.readouterr().err.count("deprecated: logging.trackio is now logging.report_to") == 1
