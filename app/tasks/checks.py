"""The run side's check of the names its config gives, at start: the config only checks their shape (`core.config`,
which knows no task, environment or reward), the run finds out here, before anything runs, whether they resolve."""

from __future__ import annotations

from app.tasks.environments import resolve_environment
from app.tasks.problems import reasoning_gym_mix
from app.tasks.rewards import resolve_reward
from core.config import ConfigError


def check_names(cfg) -> None:
    """The names a run's config gives (`env.name`, `task.reward_funcs`, the reasoning-gym datasets of
    `task.datasets` and their configs) resolve: ConfigError naming the field else, at start, not mid-run (the
    config itself only checks their shape, `core.config`)."""
    named = [("env.name", cfg.env.name, resolve_environment)] if cfg.env.name else []
    named += [(f"task.reward_funcs[{i}]", name, resolve_reward) for i, name in enumerate(cfg.task.reward_funcs)]
    for field, name, resolve in named:
        try:
            resolve(name)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None
    if cfg.env.factory is not None:
        check_factories(cfg)
    if cfg.env.openenv is not None:
        check_openenv(cfg.env.openenv)
    if cfg.env.verifiers is not None:
        from app.tasks.verifiers_tasksets import check_verifiers  # imports verifiers: only runs that name it pay

        check_verifiers(cfg)
    if cfg.task.name == "reasoning_gym":
        reasoning_gym_mix(cfg.task, cfg.task.seed, 1)  # makes each dataset with its config, as the splits will


def check_openenv(oe) -> None:
    """`env.openenv` names client and Action classes that fit and an app that imports, resolved in the OpenEnv venv
    as the run will (`app.tasks.openenv_env.check_classes`): ConfigError naming the field else, and one saying what
    builds the venv where there is none (the server itself starts only with the run)."""
    from app.tasks.openenv_env import check_classes

    try:
        check_classes(oe)
    except ValueError as e:
        named = str(e).split(":")[0] in ("client", "action", "action_field", "app")  # the message starts with it
        raise ConfigError(f"env.openenv.{e}" if named else f"env.openenv: {e}") from None


def check_factories(cfg) -> None:
    """`env.factory` imports, each factory makes an environment with a `reset` whose tools have schemas (probed once,
    as TRL's trainers probe at init), and the run has a reward source: ConfigError naming the field else."""
    from app.tasks.trl_environments import probe, resolve_factories

    spec = cfg.env.factory
    try:
        factories = resolve_factories(spec)
    except ValueError as e:
        raise ConfigError(f"env.factory: {e}") from None
    kinds = []
    for name, factory in factories.items():
        try:
            kinds.append(probe(name, factory))
        except ValueError as e:
            raise ConfigError(f"env.factory{'' if name is None else '.' + name}: {e}") from None
    tools = cfg.model.tiny.warmup_tools if cfg.model.name_or_path == "tiny" else None
    if tools is not None:  # the tiny model's warm-up plays its demonstrations (`app.tiny_tools`)
        from app.tasks.registry import resolve_named

        try:
            if not callable(resolve_named(tools.demonstration, {}, "demonstration", "module:callable")):
                raise ValueError(f"{tools.demonstration!r} is not callable")
        except ValueError as e:
            raise ConfigError(f"model.tiny.warmup_tools.demonstration: {e}") from None
    if not cfg.task.reward_funcs and not any(k.owns_reward for k in kinds):
        raise ConfigError(
            "task.reward_funcs: no reward source: name reward functions, or give the environment a get_reward()"
        )
