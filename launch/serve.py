"""The fleet's entry point: `serve run serve_config.yaml` (`make serve`) imports `build_app` here.

It reads a fleet config file (`core.config.FleetConfig`), builds the tiny model where that is the base model (or
the teacher's), pins a hub model's revision, and hands both to the fleet's builder (`deployments.fleet.fleet_app`).
It sits above both products because building the tiny model is the run side's (`app.tiny_model`, which warms it up
on the run's task): the fleet itself only ever loads a model folder it is given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from app.tiny_model import prepare_model
from core.bucket.filesystem import absolute_bucket_url
from core.config import REPO_ROOT, ConfigError, load_fleet_config
from core.models import pin_revision
from deployments.fleet import fleet_app

log = logging.getLogger("ray.serve")  # Serve shows this logger's lines in the app-build and controller logs

DEFAULT_FLEET_CONFIG = REPO_ROOT / "configs" / "fleet-tiny-cpu.yaml"


def build_app(args: dict[str, Any]):
    """Entry point of `serve run serve_config.yaml`: args `config` (a fleet config file) and `overrides`."""
    path = Path(args.get("config") or DEFAULT_FLEET_CONFIG)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path  # `serve run` may build the app in a process started elsewhere
    overrides = list(args.get("overrides") or [])
    if any(str(o).partition("=")[0].strip() == "fleet.admin_token" for o in overrides):
        raise ConfigError("fleet.admin_token: not in serve_config.yaml (Serve shows it); export SPOTRL_ADMIN_TOKEN")
    cfg = load_fleet_config(path, overrides)
    model_path = prepare_model(cfg.model, cfg.tiny_task, log=log.info)
    if cfg.teacher is not None:
        prepare_model(cfg.teacher.model, cfg.tiny_task, log=log.info)
    pin_revision(cfg.model, model_path, log=log.info)  # every replica, restarts included, loads one commit
    log.info(
        "fleet: %d replicas of %s, bucket %s", cfg.fleet.num_replicas, model_path, absolute_bucket_url(cfg.bucket_url)
    )
    return fleet_app(cfg, model_path)
