"""Recipe: a kind of environment of your own, in one file: its config, its runtime and one registry line.

    .venv/bin/python -m examples.kind_inline steps=20 num_problems=64       # any field of Config below, as key=value

A kind decides, for a run: where its problems come from, what it checks at start (before Ray and the fleet), what
it serves for the run's length and what plays a group of its episodes (a `Sampler`). spotrl's own kinds are one
module each in `app/kinds/` (single-turn, spotrl's environments, OpenEnv, TRL's `environment_factory`, verifiers),
their configs fields of `EnvConfig`. A kind of one's own is this file: its config (`InlineConfig`, a field of an
`EnvConfig` subclass made by `env_kind`), its `EnvKind`, and `register_kind(...)`. This one brings its problems
written out in the config, and plays them as single-turn completions scored by the task's reward functions.
"""

from __future__ import annotations

import random
import sys

import yaml
from pydantic import BaseModel, ConfigDict, Field

from app.kinds.kind import EnvKind
from app.kinds.registry import register_kind
from app.rollout.sampling import CompletionSampler
from app.tasks.problems import Problem, TaskSplits, arithmetic_prompt
from app.tasks.rewards import RewardScorer
from core.config import ConfigError, RunConfig, config_errors_exit, load_config
from core.config.envs import EnvConfig, env_kind
from core.config.sections import Section


class Config(BaseModel):
    """The recipe's knobs; anything else of the run's config is a `sets` override (`--set` of `spotrl train`)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field("configs/tiny-cpu.yaml", description="The run's YAML to start from (the embedded default).")
    steps: int = Field(20, ge=1, description="Training steps (train.max_steps).")
    run_name: str = Field("inline-kind", description="runs/<run_name>/ holds the run's metrics and summary.")
    num_problems: int = Field(64, ge=2, description="Additions written into env.inline.problems.")
    num_heldout: int = Field(16, ge=1, description="The first this many of them are held out.")
    seed: int = Field(7, description="Seed of the additions.")
    sets: list[str] = Field(default_factory=list, description="More KEY=VALUE overrides of the run's config.")


class InlineConfig(Section):
    """The kind's config, `env.inline`: problems written out as (question, answer) pairs."""

    problems: list[tuple[str, str]] = Field(min_length=2, description="(question, answer) pairs.")
    num_heldout: int = Field(1, ge=1, description="The first this many problems are held out, the rest trained on.")


class Inline(EnvKind):
    """The kind's runtime: its problems are its config's, its groups single-turn completions scored by rewards."""

    field = "inline"

    def problems(self, cfg) -> TaskSplits:
        own = cfg.env.inline
        rows = [Problem(f"inline-{i}", question, answer) for i, (question, answer) in enumerate(own.problems)]
        return TaskSplits(train=rows[own.num_heldout :], heldout=rows[: own.num_heldout])

    def check(self, cfg) -> None:
        own = cfg.env.inline
        if own.num_heldout >= len(own.problems):
            raise ConfigError(f"env.inline.num_heldout={own.num_heldout}: leaves no problem to train on")
        if any(not answer.strip() for _, answer in own.problems):
            raise ConfigError("env.inline.problems: every problem needs an answer")

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        task = cfg.task
        scorer = RewardScorer.from_names(task.reward_funcs, task.reward_timeout_s, cfg.train.max_steps, task.weights())
        return CompletionSampler(generate, scorer, decode)


class InlineEnvConfig(EnvConfig):
    """`env` with the new kind among its fields (inside spotrl: one more field of `EnvConfig` itself)."""

    inline: InlineConfig | None = env_kind("Problems written out in the config, played as single-turn completions.")


class InlineRunConfig(RunConfig):
    """A run whose `env` knows the new kind."""

    env: InlineEnvConfig = Field(default_factory=InlineEnvConfig, description="Multi-turn environment, or a kind.")


register_kind(Inline())  # the registry line: at import, so every process that reads an InlineRunConfig has it


def additions(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` distinct two-digit additions in the embedded default's wording (the tiny model answers them)."""
    rng, seen = random.Random(seed), {}
    while len(seen) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        seen[arithmetic_prompt(a, b)] = str(a + b)
    return list(seen.items())


def run_config(config: Config) -> InlineRunConfig:
    """The run: the base config with the recipe's overrides, its `env.inline` the additions."""
    sets = [f"train.max_steps={config.steps}", f"logging.run_name={config.run_name}", *config.sets]
    base = load_config(config.base, sets).model_dump()
    inline = {"problems": additions(config.num_problems, config.seed), "num_heldout": config.num_heldout}
    return InlineRunConfig.model_validate(base | {"env": base["env"] | {"inline": inline}})


def parse(argv: list[str]) -> Config:
    """`key=value` arguments (values read as YAML, as `--set` reads them) into the recipe's Config."""
    pairs = [a.split("=", 1) for a in argv]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected key=value arguments, the fields of Config: {', '.join(Config.model_fields)}")
    return Config.model_validate({k: yaml.safe_load(v) for k, v in pairs})


def main(argv: list[str] | None = None) -> None:
    from launch.train import run

    with config_errors_exit():  # one line and exit 2, as `spotrl train` says it
        cfg = run_config(parse(sys.argv[1:] if argv is None else argv))
    run(cfg)  # as `spotrl train` runs a config: the kind's own start-up check among its names, before Ray


if __name__ == "__main__":
    from examples.kind_inline import main as recipe_main  # by its module name: Ray's workers import it so

    recipe_main()
