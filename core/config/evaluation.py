"""Evaluation during training (`eval`): how often the newest committed version is evaluated while the run trains,
on which sets besides the run's held-out split, and whether the best one is kept as the run's final adapter.

The driver runs these evaluations in the background (`app.periodic_eval`); before and after the run it evaluates
the held-out split whatever this section says.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from core.config.envs import EnvConfig
from core.config.sections import Section
from core.config.tasks import RunTask


class EvalSet(Section):
    """One more set evaluated beside the held-out split: another task's held-out split (e.g. a reasoning-gym
    dataset), played single-turn or in its own environment (e.g. a verifiers taskset)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Its name in the metrics: eval/<name>/accuracy.")
    task: RunTask = Field(..., description="Its task, whose held-out split is evaluated (as a run's `task`).")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Its environment (none: single-turn completions).")

    def applied_to(self, cfg: Any) -> Any:
        """`cfg` (a RunConfig) with this set's task and environment (and no extra sets of its own): what
        `app.evaluate.evaluate` measures it with."""
        return cfg.model_copy(update={"task": self.task, "env": self.env, "eval": EvalConfig()})


class EvalConfig(Section):
    """Evaluation during training: every `every_steps` steps, in the background, the learner never waiting for it."""

    every_steps: int = Field(
        0, ge=0, description="Evaluate the newest committed version every this many steps (0: only before and after)."
    )
    extra: list[EvalSet] = Field(
        default_factory=list, description="More sets evaluated with the held-out split, each under its own name."
    )
    keep_best: bool = Field(
        False, description="Copy the best evaluated version to runs/<name>/best_adapter, the run's final adapter."
    )
    max_retries: int = Field(
        2, ge=0, description="Retries of an evaluation that failed (a lost replica) before it is skipped, counted."
    )
    reward_funcs: list[str] | None = Field(
        None,
        description="What the held-out split is scored by (solved: a positive sum), e.g. exact_answer beside a judge, "
        "each weighing 1.0; None: task.reward_funcs, with task.reward_weights.",
    )

    @field_validator("extra")
    @classmethod
    def _distinct_names(cls, sets: list[EvalSet]) -> list[EvalSet]:
        names = [s.name for s in sets]
        if len(set(names)) != len(names) or "heldout" in names:
            raise ValueError(f"eval.extra: names must be distinct and not 'heldout' (got {names})")
        return sets


def scored_as_evaluated(cfg: Any) -> Any:
    """`cfg` (a RunConfig) as its held-out split is scored: its task rewarded by `eval.reward_funcs` where it names
    them (a run rewarded by a judge, measured by the exact answer), each weighing 1.0: `task.reward_weights` weigh
    the task's functions, not these."""
    if cfg.eval.reward_funcs is None:
        return cfg
    task = cfg.task.model_copy(update={"reward_funcs": cfg.eval.reward_funcs, "reward_weights": None})
    return cfg.model_copy(update={"task": task})
