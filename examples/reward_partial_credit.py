"""Recipe: a reward function of your own, trained on by naming it in `task.reward_funcs`.

    .venv/bin/python -m examples.reward_partial_credit steps=20        # any field of Config below, as key=value

A reward is a plain function with TRL's signature: called by keyword (`completions`, `prompts`, `completion_ids`,
the problem's columns such as `answer`, `trainer_state`, `log_metric`, ...), it returns one float (or None: not
scored) per sample. Nothing here knows spotrl: the same function drops into TRL's `GRPOTrainer(reward_funcs=[...])`.
spotrl sums the functions named, and one that raises or hangs costs its samples' scores (`reward/errors/<name>`),
never the run. This one gives partial credit to a numeric answer close to the gold, so a small model that is almost
right sees a gradient where exact-match alone gives every sample of its group 0.
"""

from __future__ import annotations

import sys

import yaml
from pydantic import BaseModel, ConfigDict, Field


class Config(BaseModel):
    """The recipe's knobs; anything else of the run's config is a `sets` override (`--set` of `spotrl train`)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field("configs/tiny-cpu.yaml", description="The run's YAML to start from (the embedded default).")
    steps: int = Field(20, ge=1, description="Training steps (train.max_steps).")
    run_name: str = Field("partial-credit", description="runs/<run_name>/ holds the run's metrics and summary.")
    exact_too: bool = Field(True, description="Sum exact_answer with the partial credit (full marks stay distinct).")
    sets: list[str] = Field(default_factory=list, description="More KEY=VALUE overrides of the run's config.")


# How far off an answer may be and still earn something: credit falls linearly from 0.5 (off by one) to 0 at NEAR.
NEAR = 5


def close_answer(completions, answer, log_metric=None, **kwargs) -> list[float | None]:
    """0.5 x (1 - distance / NEAR) for an integer answer within NEAR of the gold (the exact answer included), 0 for
    one further off, None where the completion holds no integer at all (nothing to score: no advantage)."""
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]  # TRL's chat form too
        words = text.strip().split()
        try:
            given = int(words[0]) if words else None
        except ValueError:
            given = None
        if given is None:
            scores.append(None)
            continue
        distance = abs(given - int(gold))
        scores.append(0.5 * max(0.0, 1.0 - distance / NEAR) if distance else 0.5)
    if log_metric is not None:  # averaged per step into reward/logged/parsed_share
        log_metric("parsed_share", sum(s is not None for s in scores) / max(len(scores), 1))
    return scores


def train_args(config: Config) -> list[str]:
    """The driver's command line (`launch.train`, what `spotrl train` runs) for this recipe's run."""
    rewards = ["exact_answer"] * config.exact_too + [f"{__name__}:close_answer"]
    sets = [
        f"task.reward_funcs=[{', '.join(rewards)}]",
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
    from examples.reward_partial_credit import main as recipe_main  # by its module name: Ray's workers import it so

    recipe_main()
