"""Starts the Tinker API beside a running fleet: the learner actor (`app/`) and the Serve application (`deployments/`).

It sits in `launch/` because it is the one place that wires the two products together: the learner's class is the
run side's (`app.learner.tinker_learner.TinkerLearner`), the HTTP service is the fleet's (`deployments.tinker`), and
they meet only as a named actor and `contracts.tinker`'s messages. Afterwards `TINKER_BASE_URL` is the fleet's URL.
"""

from __future__ import annotations

from contracts.auth import Secret
from contracts.tinker import LEARNER_NAMESPACE, TINKER_APP, TINKER_ROUTE_PREFIX, learner_name
from core.config.tinker import TinkerConfig
from deployments.tinker.settings import TinkerSettings

_started: dict = {}  # the learner actors this process started (`learner_actor`)


def learner_actor(index: int = 0):
    """The handle of learner `index` that `start_tinker` started (a test kills it to play a preemption)."""
    return _started["learners"][index]


def start_tinker(settings: TinkerSettings, admin_token: str | None, num_cpus: float = 0, spot=None) -> str:
    """Start the learner actors and the Serve application on the connected Ray; returns the base URL for the SDK.
    `spot` (`core.config.SpotConfig`): how the learner watches its node for notices (None: it does not)."""
    import ray
    from ray import serve

    from app.learner.tinker_group import TinkerLearnerGroup
    from app.learner.tinker_learner import TinkerLearner
    from deployments.tinker.shell import tinker_app

    # A learner whose process dies (its node preempted, a crash) is started again by Ray with the base model alone;
    # the service restores each client from its last saved state on its next call (`deployments.tinker.recovery`);
    # after a notice for its node, that state is the one after the client's last optimizer step. Over several devices
    # the named actor is a group that starts its ranks again itself when one dies.
    args = (settings.model_path, settings.max_models, spot, settings.learner_device, settings.learner_dtype)
    learners = []
    for index in range(settings.learners):
        options = {"name": learner_name(index), "namespace": LEARNER_NAMESPACE, "max_restarts": -1}
        if settings.learner_ranks == 1:
            gpus = 1 if settings.learner_device == "cuda" else 0
            learner = ray.remote(TinkerLearner).options(**options, num_cpus=num_cpus, num_gpus=gpus).remote(*args)
        else:
            cpus_per_rank = num_cpus or 0.01  # a placement group's bundle cannot be empty: a sliver, as one actor's 0
            learner = (
                ray.remote(TinkerLearnerGroup)
                .options(**options, num_cpus=0)
                .remote(*args, ranks=settings.learner_ranks, cpus_per_rank=cpus_per_rank)
            )
        learners.append(learner)
    ray.get([learner.models.remote() for learner in learners])  # up, with the base model loaded
    _started["learners"] = learners
    serve.run(
        tinker_app(settings, Secret(admin_token) if admin_token else None, learners),
        name=TINKER_APP,
        route_prefix=TINKER_ROUTE_PREFIX,
    )
    return settings.fleet_url


def stop_tinker() -> None:
    import ray
    from ray import serve

    serve.delete(TINKER_APP)
    for learner in _started.pop("learners", []):
        ray.kill(learner, no_restart=True)


def build_parser():
    """The options of `main` (`spotrl tinker --help` lists the fleet config's fields after them)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default=None, help="the fleet's config file (default: the tiny CPU fleet)")
    parser.add_argument("--set", action="append", default=[], help="a fleet config override, key=value")
    for name, field in TinkerConfig.model_fields.items():  # the fleet's `tinker:` section, flag by flag
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(flag, type=type(field.default), default=None, help=f"{field.description} (tinker.{name})")
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m launch.tinker [--config FLEET.yaml] [--set key=value ...] [--max-models N ...]`: the Tinker API
    beside a fleet already running on this machine's Ray (`make serve`); runs until interrupted (the learner is
    this process's actor). Then `TINKER_BASE_URL=<fleet URL>`, and an API key from `POST /api/v1/admin/keys`."""
    import signal
    import sys

    import httpx
    import pydantic
    import ray

    from contracts.auth import admin_token as resolve_admin_token
    from core.config import load_fleet_config
    from deployments.fleet import fleet_url
    from tiny.build import prepare_model

    args = build_parser().parse_args(argv)
    cfg = load_fleet_config(args.config, args.set)
    model_path = prepare_model(cfg.model)
    ray.init(address="auto", namespace=LEARNER_NAMESPACE)
    url = fleet_url(cfg)
    token = resolve_admin_token(cfg)
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=30)
    limits = {k: v for k, v in vars(args).items() if k in TinkerConfig.model_fields and v is not None}
    try:
        models.raise_for_status()  # the fleet is up; the service names the base model by its configured id
        settings = TinkerSettings.of_fleet(
            cfg, url, cfg.model.name_or_path, model_path, cache_dir=str(cfg.bucket.cache_dir), **limits
        )
    except pydantic.ValidationError as exc:
        print(f"tinker settings: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    start_tinker(settings, token, spot=cfg.spot)
    print(f"Tinker API up: TINKER_BASE_URL={url}  (keys: POST {url}/api/v1/admin/keys with the admin token)")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop_tinker()


if __name__ == "__main__":
    main()
