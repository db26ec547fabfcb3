"""The run side's check of its config at start: the config only checks its shape (`core.config`, which knows no
task, environment or reward); the run finds out here, before Ray or the fleet start, whether the names resolve,
the splits can be drawn, and its kind of environment can run (its own check, `app.kinds`: a TRL environment's
`reset` takes the problems' rows, an OpenEnv client fits, a verifiers taskset loads), and (once the model's
tokenizer is there, `check_episode_budget`) its first problem fits the episode's budget. Each failure is one
ConfigError naming the setting that fixes it."""

from __future__ import annotations

from app.kinds.registry import kind_of
from app.tasks.problems import load_task, reasoning_gym_mix
from app.tasks.rewards import resolve_reward
from core.config import ConfigError


def check_names(cfg) -> None:
    """The names a run's config gives (its environment's, `task.reward_funcs`, the reasoning-gym datasets of
    `task.datasets` and their configs) resolve: ConfigError naming the field else, at start, not mid-run (the
    config itself only checks their shape, `core.config`)."""
    for i, name in enumerate(cfg.task.reward_funcs):
        try:
            resolve_reward(name)
        except ValueError as e:
            raise ConfigError(f"task.reward_funcs[{i}]: {e}") from None
    kind_of(cfg).check(cfg)
    if cfg.task.name == "reasoning_gym":
        reasoning_gym_mix(cfg.task, cfg.task.seed, 1)  # makes each dataset with its config, as the splits will
        # The splits themselves (a few seconds): a size the datasets cannot fill is found now, not after the fleet.
        load_task(cfg.task)
    each_eval_set(cfg, check_names)


def check_episode_budget(cfg, model_path: str) -> None:
    """The run's first problem, rendered as its kind renders it, leaves the model room in the episode's budget
    (`EnvKind.check_budget`): ConfigError naming the setting that makes room else. Called once the model's tokenizer
    exists."""
    kind_of(cfg).check_budget(cfg, model_path)
    each_eval_set(cfg, lambda set_cfg: check_episode_budget(set_cfg, model_path))


def each_eval_set(cfg, check) -> None:
    """`check` each extra evaluation set (`eval.extra`) as a run of its own task and environment, its ConfigError
    naming the set."""
    for i, eval_set in enumerate(cfg.eval.extra):
        try:
            check(eval_set.applied_to(cfg))
        except ConfigError as e:
            raise ConfigError(f"eval.extra[{i}] ({eval_set.name}): {e}") from None
