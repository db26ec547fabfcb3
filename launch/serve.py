"""The fleet's entry point: `serve run serve_config.yaml` (`make serve`) imports `build_app` here.

`spotrl serve [--config FLEET.yaml] [--set key=value ...]` (`python -m launch.serve`, `main`) runs what `make serve`
runs, `ops/serve_local.sh` (a Ray head on 127.0.0.1, then `serve run`), on `serve_config.yaml` or, given a fleet
config or overrides, on a copy of it that names them (and the fleet's host and port, which Serve's HTTP options must
repeat).

It reads a fleet config file (`core.config.FleetConfig`), builds the tiny model where that is the base model (or
a teacher deployment's or a judge deployment's: the embedded default's, since a fleet names no task; another task's
is named by its folder), pins a hub model's revision, and hands both to the fleet's builder
(`deployments.fleet.fleet_app`). It sits above both products because building the tiny model is neither's
(`tiny.build`): the fleet only ever loads a folder it is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from core.bucket.filesystem import absolute_bucket_url
from core.config import REPO_ROOT, ConfigError, FleetConfig, config_errors_exit, load_fleet_config
from core.models import pin_revision
from deployments.fleet import fleet_app, proxy_port
from tiny.build import name_built, prepare_model

log = logging.getLogger("ray.serve")  # Serve shows this logger's lines in the app-build and controller logs

DEFAULT_FLEET_CONFIG = REPO_ROOT / "configs" / "fleet-tiny-cpu.yaml"
SERVE_CONFIG = REPO_ROOT / "serve_config.yaml"
SERVE_LOCAL = REPO_ROOT / "ops" / "serve_local.sh"


def serve_fleet_config(config: str | None, overrides: list[str]) -> FleetConfig:
    """The fleet config a Serve config names (a path relative to the repository too), its admin token kept out."""
    path = Path(config or DEFAULT_FLEET_CONFIG)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path  # `serve run` may build the app in a process started elsewhere
    if any(str(o).partition("=")[0].strip() == "fleet.admin_token" for o in overrides):
        raise ConfigError("fleet.admin_token: not in serve_config.yaml (Serve shows it); export SPOTRL_ADMIN_TOKEN")
    return load_fleet_config(path, overrides)


def build_app(args: dict[str, Any]):
    """Entry point of `serve run serve_config.yaml`: args `config` (a fleet config file) and `overrides`."""
    cfg = serve_fleet_config(args.get("config"), list(args.get("overrides") or []))
    model_path = prepare_model(cfg.model, log=log.info)
    for deployment in cfg.deployments().values():  # a teacher's, a judge's: its replicas load the folder it names
        name_built(deployment.model, log=log.info)
    pin_revision(cfg.model, model_path, log=log.info)  # every replica, restarts included, loads one commit
    log.info(
        "fleet: %d replicas of %s, bucket %s", cfg.fleet.num_replicas, model_path, absolute_bucket_url(cfg.bucket_url)
    )
    return fleet_app(cfg, model_path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="A fleet on its own, as `make serve` starts it (ops/serve_local.sh).")
    parser.add_argument("--config", default=None, help="The fleet's config file (default: serve_config.yaml's).")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="Override a field."
    )
    return parser


def serve_config_with(serve_config: dict, config: str | None, overrides: list[str], host: str, port: int) -> dict:
    """`serve_config` (serve_config.yaml's contents) naming this fleet config and overrides, Serve's proxy at host:port
    (the fleet's `proxy_port`: the fleet's own front door takes `fleet.port`)."""
    (app, *others) = serve_config["applications"]
    args = {**app.get("args", {}), "overrides": [*app.get("args", {}).get("overrides", []), *overrides]}
    if config is not None:
        args["config"] = str(Path(config).resolve())
    http = {**serve_config.get("http_options", {}), "host": host, "port": port}
    return {**serve_config, "http_options": http, "applications": [{**app, "args": args}, *others]}


def main(argv: list[str] | None = None) -> None:
    """Validate the fleet config first (one line and exit 2, before Ray starts), then become `ops/serve_local.sh`."""

    args = build_parser().parse_args(argv)
    path = SERVE_CONFIG
    if args.config is not None or args.overrides:
        shipped = yaml.safe_load(SERVE_CONFIG.read_text())
        with config_errors_exit():
            cfg = serve_fleet_config(args.config or shipped["applications"][0]["args"]["config"], args.overrides)
        config = serve_config_with(shipped, args.config, args.overrides, cfg.fleet.host, proxy_port(cfg))
        with tempfile.NamedTemporaryFile("w", prefix="spotrl-serve-", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(config, f, sort_keys=False)  # kept: `serve run` reads it after this process is replaced
        path = Path(f.name)
    os.execv("/bin/bash", ["bash", str(SERVE_LOCAL), str(path)])


if __name__ == "__main__":
    main()
