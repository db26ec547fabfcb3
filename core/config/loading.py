"""Reading configs: YAML files, `--set key=value` overrides, and one-line errors that name the field.

An invalid file or override is a `ConfigError` whose message names the field, never a traceback; entry
points print it and exit with code 2 (`config_errors_exit`, `config_from_args`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import SecretStr, ValidationError

from core.config.deprecated import move_grpo_keys
from core.config.fleet import FleetConfig
from core.config.run import RunConfig
from core.config.sections import CONFIG_DIR

DEFAULT_CONFIG = CONFIG_DIR / "tiny-cpu.yaml"
DEFAULT_FLEET_CONFIG = CONFIG_DIR / "fleet-tiny-cpu.yaml"
ConfigT = TypeVar("ConfigT", RunConfig, FleetConfig)


class ConfigError(ValueError):
    """An invalid configuration, with a one-line message naming the field."""


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{field}: unknown key"
    msg = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    if kind != "missing" and not isinstance(value, dict | SecretStr):  # a secret is never quoted
        msg += f" (got {value!r})"
    return f"{field}: {msg}" if field else msg


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. lora.rank=8")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"--set {item!r}: {key!r} is not a dotted field name")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as it is and let the field validate it
    return key.split("."), value


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a run's YAML file (default: the embedded tiny-cpu config), apply `key=value` overrides, validate."""
    return _load(RunConfig, Path(path) if path else DEFAULT_CONFIG, overrides)


def load_fleet_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> FleetConfig:
    """Load a fleet's YAML file (default: the embedded tiny-cpu fleet), apply `key=value` overrides, validate."""
    return _load(FleetConfig, Path(path) if path else DEFAULT_FLEET_CONFIG, overrides)


def _load(schema: type[ConfigT], path: Path, overrides: list[str] | tuple[str, ...]) -> ConfigT:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}:{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    moved = move_grpo_keys if schema is RunConfig else lambda d: d
    try:
        data = moved(data)  # the file's old keys first, so that a later `--set grpo.<key>` wins over its new key
        for item in overrides:
            _apply_override(data, *_parse_override(item))
            data = moved(data)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def add_config_args(parser) -> None:
    """Add the `--config FILE` and repeatable `--set KEY=VALUE` options every entry point shares."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config file (default: tiny-cpu).")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one field, e.g. --set lora.rank=8 (repeatable).",
    )


@contextlib.contextmanager
def config_errors_exit(*also: type[Exception]) -> Iterator[None]:
    """What every entry point does with a config error raised inside (a `ConfigError`, or one of `also`): one line on
    stderr naming the field, and exit 2, never a traceback."""
    try:
        yield
    except (ConfigError, *also) as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def config_from_args(args, checks: tuple[Callable[[RunConfig], None], ...] = ()) -> RunConfig:
    """Load the config named by parsed args and run `checks` on it (the run side's: that its names resolve); exit 2
    with one line naming the field when it is invalid."""
    with config_errors_exit():
        cfg = load_config(args.config, args.overrides)
        for check in checks:
            check(cfg)
        return cfg
