"""A run's task checks itself: the fields its family needs, and no settings another family would ignore.

`TaskConfig` itself lives with the sections a fleet shares (`core.config.sections`: a tiny model is built from a
task); these are a run's checks of it, attached to `RunConfig.task` (`RunTask`), so a fleet's task is unchanged.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from core.config.sections import TaskConfig


def checked_task(task: TaskConfig) -> TaskConfig:
    """`task` when its family has what it needs; ValueError naming the field else."""
    if task.name == "math" and not task.dataset:
        raise ValueError("name math needs task.dataset")
    if task.name == "reasoning_gym" and not task.datasets:
        raise ValueError("name reasoning_gym needs at least one reasoning-gym dataset in task.datasets")
    if task.name != "reasoning_gym" and task.datasets:
        # Ignored datasets would be a run silently trained on something else than its config says.
        raise ValueError(f"task.datasets are reasoning-gym's, for name reasoning_gym (name is {task.name})")
    if task.chain_min > task.chain_max:
        raise ValueError("chain_min must not exceed chain_max")
    return task


# A run's task: a `TaskConfig` that has checked itself.
RunTask = Annotated[TaskConfig, AfterValidator(checked_task)]
