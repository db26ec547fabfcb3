"""Recipe: a multi-turn environment class of your own, trained on by naming it in `env.name`.

    .venv/bin/python -m examples.env_second_chance steps=20 attempts=3     # any field of Config below, as key=value

An environment is gym's `reset` / `step` over text (`app.tasks.environments.Environment`): `reset` gets the
problem, each `step` the model's turn (its text and the exact token ids it sampled) and answers an `EnvStep`: the
turn's reward, and either an observation for the model to read next or `done`. One instance plays one episode,
built with `env.kwargs`; spotrl keeps the episode one token sequence, trains only the model's tokens, and an
environment that raises or hangs costs its episode, never the run (`env/errors/<cause>`). This one gives the model
another go at a wrong answer, for less credit each time: the tiny model, sampling at temperature 1, often lands the
second try.
"""

from __future__ import annotations

import sys

import yaml
from pydantic import BaseModel, ConfigDict, Field

from app.tasks.environments import Environment, EnvStep
from app.tasks.problems import Problem


class Config(BaseModel):
    """The recipe's knobs; anything else of the run's config is a `sets` override (`--set` of `spotrl train`)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field("configs/tiny-cpu.yaml", description="The run's YAML to start from (the embedded default).")
    steps: int = Field(20, ge=1, description="Training steps (train.max_steps).")
    run_name: str = Field("second-chance", description="runs/<run_name>/ holds the run's metrics and summary.")
    attempts: int = Field(2, ge=1, description="Answers the model may give (its env.max_turns too).")
    decay: float = Field(0.5, gt=0, le=1, description="Credit of a right answer falls by this factor per retry.")
    sets: list[str] = Field(default_factory=list, description="More KEY=VALUE overrides of the run's config.")


RETRY = " Not quite. Try again. Answer: "  # what the model reads after a wrong answer with attempts left


class SecondChance(Environment):
    """Answer the problem; a wrong answer earns another try (up to `attempts`), a right one `decay`**tries."""

    def __init__(self, attempts: int = 2, decay: float = 0.5):
        self.attempts, self.decay = attempts, decay

    def reset(self, problem: Problem) -> None:
        self.answer, self.tries = problem.answer.strip(), 0

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        self.tries += 1
        if text.strip() == self.answer:  # `solved` is the episode's verdict for held-out accuracy
            return EnvStep(self.decay ** (self.tries - 1), done=True, solved=True)
        if self.tries >= self.attempts:
            return EnvStep(0.0, done=True, solved=False)
        return EnvStep(0.0, observation=RETRY)


def train_args(config: Config) -> list[str]:
    """The driver's command line (`launch.train`, what `spotrl train` runs) for this recipe's run."""
    sets = [
        f"env.name={__name__}:SecondChance",
        f"env.kwargs={{attempts: {config.attempts}, decay: {config.decay}}}",
        f"env.max_turns={config.attempts}",
        "model.max_model_len=96",  # room for the retries: prompt, a few turns and the observations between them
        f"train.max_steps={config.steps}",
        f"logging.run_name={config.run_name}",
        *config.sets,
    ]
    return ["--config", config.base, *(a for s in sets for a in ("--set", s))]


def parse(argv: list[str]) -> Config:
    """`key=value` arguments (values read as YAML, as `--set` reads them) into the recipe's Config."""
    pairs = [a.split("=", 1) for a in argv]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected key=value arguments, the fields of Config: {', '.join(Config.model_fields)}")
    return Config.model_validate({k: yaml.safe_load(v) for k, v in pairs})


def main(argv: list[str] | None = None) -> None:
    from launch.train import main as train

    train(train_args(parse(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    from examples.env_second_chance import main as recipe_main  # by its module name: Ray's workers import it so

    recipe_main()
