"""Old keys read for one more release: the `grpo` section, split by concern (`core.config.training`,
`core.config.objectives`), is moved to its new homes with one line naming each new key, once per process; a fleet's
`tiny_task` is dropped with one line naming what replaced it.

`RunConfig` moves them before it validates (a model_validator), so an old YAML file keeps working; `--set
grpo.<key>=...` is moved as it is applied (`core.config.loading`), so that it overrides the file's new key.
"""

from __future__ import annotations

import sys
from typing import Any

GRPO_OBJECTIVE = "objectives"  # keys that became the grpo objective's own settings
# Each old `grpo.<key>` and the section it moved to.
MOVED_GRPO_KEYS = {
    **dict.fromkeys(("num_generations", "max_completion_length", "temperature", "top_p", "top_k"), "sampling"),
    **dict.fromkeys(
        (
            "num_prompts_per_step",
            "learning_rate",
            "adam_beta1",
            "adam_beta2",
            "weight_decay",
            "max_grad_norm",
            "lr_scheduler_type",
            "warmup_steps",
            "max_steps",
            "seed",
        ),
        "train",
    ),
    "max_staleness": "rollout",
    "weight_sync_steps": "learner",
    **dict.fromkeys(
        ("epsilon", "epsilon_high", "vllm_importance_sampling_correction", "vllm_importance_sampling_cap"),
        GRPO_OBJECTIVE,
    ),
}
_warned: set[str] = set()


def new_key(key: str) -> str:
    """Where `grpo.<key>` lives now, as a user writes it."""
    home = MOVED_GRPO_KEYS[key]
    return f"objectives: [{{kind: grpo, {key}: ...}}]" if home == GRPO_OBJECTIVE else f"{home}.{key}"


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"deprecated: {message}", file=sys.stderr)


def move_grpo_keys(data: Any) -> Any:
    """`data` (a run's config as read) with each `grpo.<key>` moved to its new home, where it wins over a value
    given there (the later `--set` is the old key); ValueError for a key `grpo` never had."""
    if not isinstance(data, dict) or not isinstance(data.get("grpo"), dict):
        return data
    data = dict(data)
    for key, value in data.pop("grpo").items():
        if key not in MOVED_GRPO_KEYS:
            raise ValueError(f"grpo.{key}: unknown key")
        home = MOVED_GRPO_KEYS[key]
        if home != GRPO_OBJECTIVE:
            data[home] = {**(data.get(home) or {}), key: value}
            _warn(f"grpo.{key} is now {new_key(key)} (grpo is read for one more release)")
            continue
        objectives = [dict(o) if isinstance(o, dict) else o for o in data.get("objectives", [{"kind": "grpo"}])]
        grpo = next((o for o in objectives if isinstance(o, dict) and o.get("kind") == "grpo"), None)
        if grpo is None:  # a run without GRPO never read it
            _warn(f"grpo.{key} is ignored: the run has no grpo objective, whose setting it is now")
            continue
        grpo[key] = value
        data["objectives"] = objectives
        _warn(f"grpo.{key} is now the grpo objective's: {new_key(key)} (grpo is read for one more release)")
    return data


# A fleet's `tiny_task` named the task its tiny model was warmed up on: a fleet names a built model instead.
TINY_TASK_GONE = (
    "tiny_task is ignored: a fleet's model.name_or_path names the model it serves, tiny for the embedded default's or "
    "the folder `make tiny-model CONFIG=<run config>` prints for another task's (tiny_task is read for one more release)"
)


def drop_tiny_task(data: Any) -> Any:
    """`data` (a fleet's config as read) without `tiny_task`, said once."""
    if not isinstance(data, dict) or "tiny_task" not in data:
        return data
    _warn(TINY_TASK_GONE)
    return {k: v for k, v in data.items() if k != "tiny_task"}
