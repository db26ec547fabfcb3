"""The tiny model's recipe of each task, by `task.name`: the one place that tells tasks apart for the build.

Adding a task (a `TaskConfig.name`) is its recipe (a `tiny.recipe.TaskRecipe` in a module of `tiny/`) and one line in
`RECIPES`; `tests/unit/tiny/test_recipes.py` fails on a task without one.
"""

from __future__ import annotations

from app.tasks.problems import Problem
from core.config import TaskConfig, TinyModelConfig
from tiny.arithmetic import ARITHMETIC
from tiny.chains import CHAINS
from tiny.reasoning_gym import REASONING_GYM
from tiny.recipe import TaskRecipe
from tiny.warmup import Judge, WarmUpData, WarmUpPlan

RECIPES: dict[str, TaskRecipe] = {
    "arithmetic": ARITHMETIC,
    "chained_arithmetic": CHAINS,
    "reasoning_gym": REASONING_GYM,
    # MATH's problems have no generator to warm up on: a tiny model of a MATH run is arithmetic's, as it always was
    # (a MATH run is a hub model's).
    "math": ARITHMETIC,
}


def recipe_for(task: TaskConfig) -> TaskRecipe:
    return RECIPES[task.name]


def warmup_plan(
    tokenizer,
    tiny: TinyModelConfig,
    task: TaskConfig,
    heldout: list[Problem],
    pool: list[Problem],
    judge: Judge,
    render=None,
) -> WarmUpPlan:
    """The warm-up of `task`'s recipe on these held-out problems (and, for a task with reference answers, this pool)."""
    return recipe_for(task).plan(tokenizer, tiny, task, WarmUpData(heldout, [], pool), judge, render)
