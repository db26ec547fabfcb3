"""A verifiers v1 taskset as the run sees it: resolved from the config's name, its env loaded, its tasks as problems.

verifiers (`verifiers.v1`, 0.4.0) names a taskset by an id, the importable module that exports its `Taskset` subclass
in `__all__` (`verifiers.v1.utils.loaders.import_taskset`): an installed package (`gsm8k-v1`), never a dotted path
(its loader looks the id up under `verifiers.v1.tasksets.` first, which a dotted name breaks). `env.verifiers.taskset`
takes either that id or `module:TasksetClass`, any importable module that exports the class: the module is then
registered under an id of its own (`alias_id`) so that verifiers' loader, unchanged, finds it there.

The env is verifiers' own (`load_environment`: the env the taskset names, else `SingleAgentEnv`), built from its own
config (`resolve_env_config`). The run's problems are the taskset's tasks (`app.kinds.verifiers_kind`), in its
order: the first `task.num_heldout` held out, the next `task.num_train` for training; each `Problem` carries its
task's index (`VF_INDEX`), by which the sampler finds the task to play.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from app.tasks.problems import Problem, TaskSplits
from core.config import ConfigError

VF_INDEX = "vf_index"  # the Problem column holding its verifiers task's index in the taskset
ALIAS_PREFIX = "spotrl_vf__"  # the ids `module:Class` names are registered under


def alias_id(module: str) -> str:
    """The verifiers taskset id a `module:Class` spec's module is registered under (no dot, as verifiers needs)."""
    return ALIAS_PREFIX + module.replace(".", "__")


def taskset_id(spec: str) -> str:
    """The verifiers id of `env.verifiers.taskset`: an id as it is; for `module:TasksetClass`, the module registered
    under `alias_id`, once it is known to export exactly that Taskset subclass. ValueError saying what is wrong."""
    from verifiers.v1 import Taskset
    from verifiers.v1.utils.loaders import taskset_class

    if ":" not in spec:
        try:
            taskset_class(spec)
        except Exception as e:
            raise ValueError(f"{spec!r} is no verifiers taskset: {type(e).__name__}: {e}") from None
        return spec
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{spec!r} cannot be imported: {e}") from None
    found = getattr(module, attr, None)
    if not (isinstance(found, type) and issubclass(found, Taskset)):
        raise ValueError(f"{spec!r} is not a verifiers Taskset subclass")
    alias = alias_id(module_name)
    sys.modules.setdefault(alias, module)
    try:
        exported = taskset_class(alias)
    except Exception as e:  # verifiers' own refusal: no __all__, none or several Taskset subclasses exported
        raise ValueError(f"{spec!r}: {e}") from None
    if exported is not found:
        raise ValueError(f"{spec!r}: its module exports {exported.__name__} as its taskset, not {attr}")
    return alias


def env_config(vcfg) -> Any:
    """verifiers' config of the run's env (`resolve_env_config`): the taskset with its args, the agent's config (its
    harness, its runtime: a subprocess here unless it says otherwise), the episode timeout; ValueError (verifiers'
    validation) when the taskset's config refuses the args."""
    from verifiers.v1 import resolve_env_config

    raw: dict[str, Any] = {
        "id": vcfg.env_id,
        "taskset": {"id": taskset_id(vcfg.taskset), **vcfg.taskset_args},
        "timeout": {"episode": vcfg.episode_timeout_s},
    }
    # On this machine, no tunnel: verifiers' default runtime is a remote sandbox.
    raw["agent"] = {"runtime": {"type": "subprocess"}, **vcfg.agent}
    return resolve_env_config(raw)


def load_env(vcfg):
    """The run's verifiers env (its taskset loaded), as verifiers builds it (`load_environment`)."""
    from verifiers.v1 import load_environment

    return load_environment(env_config(vcfg))


def problem_of(index: int, task) -> Problem:
    """A verifiers task as a run's problem: its prompt as the chat messages an agent sends (its system prompt, then
    its prompt as a user message, or its messages as they are), so that spotrl renders it as verifiers' renderer does;
    its answer where its data has one; its index (`VF_INDEX`)."""
    data = task.data
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        prompt = [*system, {"role": "user", "content": data.prompt}]
    else:
        prompt = [*system, *(m.model_dump(exclude_none=True) for m in data.prompt or [])]
    name = data.id or data.name or str(index)
    return Problem(f"vf-{index}-{name}", prompt, str(getattr(data, "answer", "")), {VF_INDEX: index})


def task_splits(tasks: list, num_heldout: int, num_train: int) -> TaskSplits:
    """The first `num_heldout` tasks held out, the next `num_train` for training; ValueError when too few."""
    if len(tasks) < num_heldout + 1:
        raise ValueError(
            f"the taskset has {len(tasks)} tasks: too few for task.num_heldout={num_heldout} and a train split"
        )
    problems = [problem_of(i, t) for i, t in enumerate(tasks)]
    return TaskSplits(train=problems[num_heldout : num_heldout + num_train], heldout=problems[:num_heldout])


def taskset_tasks(env) -> list:
    """The taskset's tasks, in its order (an infinite taskset is cut at 100,000)."""
    taskset = env.taskset if env.taskset.bounded else env.taskset.take(100_000)
    return list(taskset)


def check_verifiers(cfg) -> None:
    """At start: the taskset resolves, its env loads with the args given, and it has tasks enough; ConfigError naming
    `env.verifiers.<field>` else."""
    vcfg = cfg.env.verifiers
    try:
        taskset_id(vcfg.taskset)
    except ValueError as e:
        raise ConfigError(f"env.verifiers.taskset: {e}") from None
    try:
        env = load_env(vcfg)
    except Exception as e:
        reason = " ".join(str(e).split())[:500]
        raise ConfigError(f"env.verifiers: verifiers cannot build the env: {type(e).__name__}: {reason}") from None
    try:
        task_splits(taskset_tasks(env), cfg.task.num_heldout, 1)
    except ValueError as e:
        raise ConfigError(f"env.verifiers.taskset: {e}") from None
