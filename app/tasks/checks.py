"""The run side's check of its config at start: the config only checks its shape (`core.config`, which knows no
task, environment or reward); the run finds out here, before Ray or the fleet start, whether the names resolve,
the splits can be drawn, a TRL environment's `reset` takes the problems' rows, and (once the model's tokenizer is
there, `check_episode_budget`) its first problem fits the episode's budget. Each failure is one ConfigError naming
the setting that fixes it."""

from __future__ import annotations

from app.tasks.environments import resolve_environment
from app.tasks.problems import Problem, load_task, reasoning_gym_mix
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
        # The splits themselves (a few seconds): a size the datasets cannot fill is found now, not after the fleet.
        load_task(cfg.task)


def first_problem(cfg) -> Problem:
    """The held-out split's first problem: the one a check plays, as the rollout and the evaluation will."""
    try:
        return load_task(cfg.task).heldout[0]
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


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
    from app.tasks.trl_environments import check_reset_takes, probe, reset_kwargs, resolve_factories, trl_row

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
    row = trl_row(first_problem(cfg))
    for kind in kinds:  # TRL passes the row by keyword (less the field that picks the environment, with several)
        try:
            check_reset_takes(kind.env_type, reset_kwargs(row, multi=kind.name is not None))
        except TypeError as e:
            raise ConfigError(f"env.factory{'' if kind.name is None else '.' + kind.name}: {e}") from None
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


def check_episode_budget(cfg, model_path: str) -> None:
    """A TRL environment's first problem, rendered with its tools as the rollout renders it (reset's observation
    included), leaves the model room in the episode's budget: ConfigError naming the setting that makes room else
    (every episode would fail at its first turn, mid-run). Called once the model's tokenizer exists."""
    if cfg.env.factory is None:
        return
    from app.tasks.trl_environments import (
        ENVIRONMENT_FIELD,
        ToolChat,
        reset_kwargs,
        resolve_factories,
        tool_methods,
        tool_tokenizer,
        trl_row,
        with_observation,
    )
    from core.models import load_tokenizer

    factories = resolve_factories(cfg.env.factory)
    multi = None not in factories
    row = trl_row(first_problem(cfg))
    env = factories[row.get(ENVIRONMENT_FIELD) if multi else None]()
    messages = list(row["prompt"])
    try:  # its observation lengthens the prompt; one that fails here is the rollout's to count, not a config error
        messages = with_observation(messages, env.reset(**reset_kwargs(row, multi)))
    except Exception:
        pass
    tools = tool_methods(env)
    try:
        chat = ToolChat(tool_tokenizer(load_tokenizer(model_path)))
    except ValueError as e:
        raise ConfigError(f"model.name_or_path: {e}") from None
    took, budget = len(chat.prompt_ids(messages, tools)), cfg.max_episode_tokens
    if took < budget:
        return
    what = f"the first problem's prompt with {type(env).__name__}'s {len(tools)} tools takes {took} tokens"
    if cfg.model.name_or_path == "tiny" and cfg.model.tiny.warmup_tools is None and tools:
        raise ConfigError(
            f"model.tiny.warmup_tools: {what}, no room in {budget}: the tiny model renders tools with Qwen2.5's "
            "template, their JSON schemas in full; set model.tiny.warmup_tools (configs/tiny-trl-tools.yaml), whose "
            "template lists the tools in one line, or raise model.max_model_len"
        )
    field = "env.max_episode_tokens" if cfg.env.max_episode_tokens is not None else "model.max_model_len"
    raise ConfigError(f"{field}={budget}: {what}, which leaves no room for the model's turn: raise it")
