"""The `spotrl` command: its subcommands, each one's help (the module's options and its config's fields, generated
from the schema), the dispatch to the modules' own mains, and the pure parts of `eval`, `runs` and `serve`."""

import json
import tomllib
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, Field

from core.config import ConfigError, FleetConfig, RunConfig, load_config
from launch.cli import COMMANDS, main, wants_help
from launch.config_help import config_keys, fields_help

REPO = Path(__file__).resolve().parents[3]


def test_pyproject_installs_the_spotrl_command_and_its_help_lists_every_command(capsys):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"spotrl": "launch.cli:main"}
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert list(COMMANDS) == ["train", "serve", "tinker", "plan", "eval", "runs"]
    for name, command in COMMANDS.items():
        assert f"    {name}" in out and command.summary.split()[0] in out


class Inner(BaseModel):
    """A nested section."""

    depth: int = Field(3, description="How deep.")


class Item(BaseModel):
    """An item of a list.

    More words that the listing leaves out."""

    kind: Literal["a"] = Field("a", description="Its kind.")


class Outer(BaseModel):
    name: str = Field("x", description="A name.")
    mode: Literal["fast", "slow"] = Field("fast", description="A mode.")
    extra: Inner | None = Field(None, description="An optional section.")
    items: list[Item] = Field(default_factory=lambda: [Item()], description="Some items.")
    limit: float | None = Field(None, description="A limit.")
    inner: Inner = Field(default_factory=Inner, description="A section.")


def test_the_listing_is_every_field_by_its_dotted_key_with_type_default_and_description():
    keys = [(k.key, k.type_text, k.default_text, k.description, k.is_section) for k in config_keys(Outer)]
    assert keys == [
        ("name", "str", "'x'", "A name.", False),
        ("mode", "fast|slow", "'fast'", "A mode.", False),
        ("items", "list[Item]", "[a]", "Some items.", False),
        ("limit", "float | null", "null", "A limit.", False),
        ("extra", "Inner", "optional section, null unless set", "An optional section.", True),
        ("extra.depth", "int", "3", "How deep.", False),
        ("items[]", "Item", "", "an item of items, set whole as YAML: An item of a list.", True),
        ("items[].kind", "a", "'a'", "Its kind.", False),
        ("inner", "Inner", "", "A section.", True),
        ("inner.depth", "int", "3", "How deep.", False),
    ]


@pytest.mark.parametrize("schema", [RunConfig, FleetConfig])
def test_every_field_of_the_shipped_schemas_is_listed_with_its_description(schema):
    """Generated from the schema: a field added anywhere (a nested section too) is in the help with no other edit."""
    listing = fields_help(schema)

    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            assert f"{key} (" in listing and (field.description or "") in listing, key
            container = get_origin(field.annotation) in (list, dict)  # its items' fields listed under key[]
            for arg in (field.annotation, *get_args(field.annotation), *map(get_args, get_args(field.annotation))):
                for model_ in arg if isinstance(arg, tuple) else (arg,):
                    if isinstance(model_, type) and issubclass(model_, BaseModel):
                        walk(model_, f"{key}[]." if container else f"{key}.")

    walk(schema, "")


def test_every_listed_key_of_a_run_is_a_key_set_takes():
    """The dotted keys are `--set`'s: each scalar field set to its listed default is never an unknown key."""
    tried = 0
    for k in config_keys(RunConfig):
        if k.is_section or "[]" in k.key or k.default_text in ("required", "null") or k.default_text.startswith("["):
            continue
        if k.key.count(".") > 1 or k.type_text.startswith("dict"):
            continue  # inside an optional or nested section: set with the section, checked above
        try:
            load_config(None, [f"{k.key}={k.default_text}"])
        except ConfigError as e:
            assert "unknown key" not in str(e), k.key
        tried += 1
    assert tried > 60


def test_help_is_asked_before_a_double_dash_only():
    assert wants_help(["--set", "lora.rank=2", "--help"]) and wants_help(["-h"])
    assert not wants_help(["--set", "lora.rank=2"]) and not wants_help(["--", "--help"])


@pytest.mark.parametrize("name", ["plan", "runs", "serve"])
def test_a_commands_help_is_its_modules_options_then_its_configs_fields(name, capsys):
    main([name, "--set", "lora.rank=2", "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: spotrl {name} ") and "--set KEY=VALUE" in out
    assert f"{COMMANDS[name].schema.__name__} fields (set any with --set KEY=VALUE" in out
    assert "\n    model.max_model_len (int, default 256): " in out
    if COMMANDS[name].schema is RunConfig:
        assert "\n    lora.rank (int, default 8): LoRA rank r." in out


def test_spotrl_plan_runs_app_plans_main_with_the_same_arguments(capsys):
    from app.plan import main as plan_main

    argv = ["--config", "configs/tiny-cpu.yaml", "--set", "lora.rank=4", "--json"]
    main(["plan", *argv])
    through_spotrl = json.loads(capsys.readouterr().out)
    plan_main(argv)
    assert json.loads(capsys.readouterr().out) == through_spotrl
    assert through_spotrl["lora_rank"] == 4


def test_spotrl_train_hands_its_arguments_to_the_driver_which_refuses_a_bad_override_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--set", "lora.rank=-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("config error: lora.rank: ")


def test_runs_show_and_remove_need_a_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["runs", "remove"])
    assert exit_.value.code == 2 and "remove needs the run's NAME" in capsys.readouterr().err


def _adapter(folder: Path) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 1}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


def test_eval_names_a_committed_version_or_an_adapter_folder(tmp_path):
    from core.bucket.filesystem import BucketError
    from core.bucket.store import AdapterStore
    from launch.evaluate import adapter_folder, committed_version

    cfg = load_config(None, [f"bucket.url=file://{tmp_path}/bucket", f"bucket.cache_dir={tmp_path}/cache"])
    store = AdapterStore.from_config(cfg)
    assert committed_version(store, None) is None  # nothing committed: the base model
    folder = _adapter(tmp_path / "adapter")
    store.publish(folder, 3)
    assert [committed_version(store, ref) for ref in (None, "policy-v3", "3", "adapters/policy-v3")] == [3, 3, 3, 3]
    with pytest.raises(BucketError, match="policy-v4 is not a committed version"):
        committed_version(store, "policy-v4")
    assert adapter_folder(str(folder)) == folder
    assert adapter_folder("policy-v3") is None and adapter_folder(str(tmp_path)) is None


def test_serve_with_a_fleet_config_runs_a_copy_of_serve_config_naming_it_on_its_port():
    import yaml

    from launch.serve import SERVE_CONFIG, serve_config_with

    shipped = yaml.safe_load(SERVE_CONFIG.read_text())
    config = serve_config_with(shipped, "configs/fleet-tiny-cpu.yaml", ["fleet.num_replicas=1"], "127.0.0.1", 8123)
    (app,) = config["applications"]
    assert app["args"] == {
        "config": str((Path.cwd() / "configs/fleet-tiny-cpu.yaml").resolve()),
        "overrides": ["fleet.num_replicas=1"],
    }
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert (
        app["import_path"] == "launch.serve:build_app"
        and app["deployments"] == shipped["applications"][0]["deployments"]
    )
    assert shipped["applications"][0]["args"]["overrides"] == []  # the shipped file's contents are left as they are
