"""A fleet's old `tiny_task` (the task its tiny model was warmed up on) loads for one more release, dropped with one
line naming what replaced it: a fleet's `model.name_or_path` names the model it serves."""

import yaml

from core.config import DEFAULT_FLEET_CONFIG, FleetConfig, deprecated, load_fleet_config

OLD_TINY_TASK = {"name": "arithmetic", "digits": 2, "num_heldout": 256}


def test_an_old_fleet_configs_tiny_task_loads_with_one_line_naming_what_replaced_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(deprecated, "_warned", set())
    old = tmp_path / "fleet.yaml"
    old.write_text(yaml.safe_dump({**yaml.safe_load(DEFAULT_FLEET_CONFIG.read_text()), "tiny_task": OLD_TINY_TASK}))
    assert load_fleet_config(old) == load_fleet_config()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("deprecated: tiny_task is ignored: a fleet's model.name_or_path names the model it serves")
    assert "make tiny-model" in line
    assert load_fleet_config(None, ["tiny_task.digits=3"]) == load_fleet_config()  # --set too, said once a process
    assert capsys.readouterr().err == ""
    assert "tiny_task" not in FleetConfig.model_fields
