"""The run side's check of its config at start: the config only checks its shape (`core.config`, which knows no
task, environment or reward); the run finds out here, before Ray or the fleet start, whether the names resolve (a
reward function's, or a judge's of `judges:`, whose template may name only what the task's problems have),
the splits can be drawn, and its kind of environment can run (its own check, `app.kinds`: a TRL environment's
`reset` takes the problems' rows, an OpenEnv client fits, a verifiers taskset loads), and (once the model's
tokenizer is there, `check_episode_budget`) its first problem fits the episode's budget. Each failure is one
ConfigError naming the setting that fixes it."""

from __future__ import annotations

from app.kinds.registry import kind_of, problems_of
from app.rollout.judges import check_template, used_judges, verdict_token_ids
from app.tasks.problems import load_task, reasoning_gym_mix
from app.tasks.rewards import REGISTRY, resolve_reward
from core.config import ConfigError
from core.config.evaluation import scored_as_evaluated
from core.config.judges import LogprobVerdict

CHECKED_PROBLEMS = 256  # of each split, whose fields a judge's template is checked against at start


def check_names(cfg) -> None:
    """The names a run's config gives (its environment's, `task.reward_funcs`, the reasoning-gym datasets of
    `task.datasets` and their configs) resolve: ConfigError naming the field else, at start, not mid-run (the
    config itself only checks their shape, `core.config`)."""
    check_reward_names(cfg, "task.reward_funcs", cfg.task.reward_funcs)
    check_reward_names(cfg, "eval.reward_funcs", cfg.eval.reward_funcs or [])
    kind_of(cfg).check(cfg)
    check_judges(cfg)
    if cfg.eval.reward_funcs is not None:
        check_judges(scored_as_evaluated(cfg))
    if cfg.task.name == "reasoning_gym":
        reasoning_gym_mix(cfg.task, cfg.task.seed, 1)  # makes each dataset with its config, as the splits will
        # The splits themselves (a few seconds): a size the datasets cannot fill is found now, not after the fleet.
        load_task(cfg.task)
    each_eval_set(cfg, check_names)


def check_reward_names(cfg, where: str, names: list[str]) -> None:
    """Each of `names` (the rewards at `where`) is a judge of `judges:` or a reward function that resolves."""
    for i, name in enumerate(names):
        if name in cfg.judges:
            continue
        try:
            resolve_reward(name)
        except ValueError as e:
            known = f" or a judge of judges ({', '.join(sorted(cfg.judges))})" if cfg.judges else ""
            raise ConfigError(f"{where}[{i}]: {e}{known}") from None


def check_judges(cfg) -> None:
    """The judges the run rewards or measures with: none named as a registered reward function is, only where the
    run's kind of environment has them score its samples (single-turn completions, or episodes: `EnvKind.unjudged`
    says why a kind does not), and each template naming only fields the task's problems have (checked on both splits'
    first problems)."""
    named = list(used_judges(cfg))
    for name in cfg.judges:
        if name in REGISTRY:
            raise ConfigError(f"judges.{name}: the name of a registered reward function; name the judge otherwise")
    if not named:
        return
    unjudged = kind_of(cfg).unjudged
    if unjudged is not None:
        raise ConfigError(
            f"judge {named[0]!r} is named in task.reward_funcs or eval.reward_funcs, but no judge scores the episodes "
            f"of env.{cfg.env.kind}: {unjudged}"
        )
    splits = problems_of(cfg)
    problems = splits.train[:CHECKED_PROBLEMS] + splits.heldout[:CHECKED_PROBLEMS]
    for name in named:
        try:
            check_template(name, cfg.judges[name].template, problems)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_judge_tokens(cfg, tokenizer) -> None:
    """A logprob judge's `yes_token` and `no_token` are one token each of the run's tokenizer (ConfigError naming the field)."""
    for name, judge in used_judges(cfg).items():
        if isinstance(judge.verdict, LogprobVerdict):
            try:
                verdict_token_ids(tokenizer, name, judge.verdict)
            except ValueError as e:
                raise ConfigError(str(e)) from None


def check_episode_budget(cfg, model_path: str) -> None:
    """The run's first problem, rendered as its kind renders it, leaves the model room in the episode's budget
    (`EnvKind.check_budget`): ConfigError naming the setting that makes room else. Called once the model's tokenizer
    exists."""
    kind_of(cfg).check_budget(cfg, model_path)
    if used_judges(cfg):
        from core.models import load_tokenizer

        check_judge_tokens(cfg, load_tokenizer(model_path))
    each_eval_set(cfg, lambda set_cfg: check_episode_budget(set_cfg, model_path))


def each_eval_set(cfg, check) -> None:
    """`check` each extra evaluation set (`eval.extra`) as a run of its own task and environment, its ConfigError
    naming the set."""
    for i, eval_set in enumerate(cfg.eval.extra):
        try:
            check(eval_set.applied_to(cfg))
        except ConfigError as e:
            raise ConfigError(f"eval.extra[{i}] ({eval_set.name}): {e}") from None
