"""A verifiers v1 taskset as the run sees it (`app.tasks.verifiers_tasksets`): named by verifiers' id or by
`module:TasksetClass`, its env built by verifiers, its tasks the run's splits, refused at start in one line when it
does not resolve; with the example taskset (`examples/verifiers_arithmetic.py`) and verifiers 0.4.0 as installed."""

import pytest

from app.kinds.registry import problems_of
from app.tasks.problems import make_arithmetic
from app.tasks.verifiers_tasksets import VF_INDEX, alias_id, check_verifiers, load_env, taskset_id
from core.config import ConfigError, RunConfig, load_config

EXAMPLE = "examples.verifiers_arithmetic:ArithmeticTaskset"


def _cfg(**verifiers):
    cfg = load_config(None, ["task.num_heldout=8", "task.num_train=20"])
    return RunConfig.model_validate(cfg.model_dump() | {"env": {"verifiers": {"taskset": EXAMPLE, **verifiers}}})


def test_a_module_and_class_become_an_id_that_verifiers_own_loader_finds():
    from verifiers.v1.utils.loaders import taskset_class

    from examples.verifiers_arithmetic import ArithmeticTaskset

    ident = taskset_id(EXAMPLE)
    assert ident == alias_id("examples.verifiers_arithmetic") and "." not in ident
    assert taskset_class(ident) is ArithmeticTaskset
    assert taskset_id(ident) == ident  # an id verifiers resolves is taken as it is


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("no_such_module_xyz:Taskset", "cannot be imported"),
        ("examples.verifiers_arithmetic:ArithmeticTask", "not a verifiers Taskset subclass"),
        ("examples.verifiers_arithmetic:Nothing", "not a verifiers Taskset subclass"),
        ("no-such-taskset-v1", "no verifiers taskset"),
    ],
)
def test_a_name_that_is_no_taskset_says_why(spec, reason):
    with pytest.raises(ValueError, match=reason):
        taskset_id(spec)


def test_the_tasksets_tasks_are_the_runs_splits_in_its_order():
    cfg = _cfg(taskset_args={"num_tasks": 40, "seed": 1234})
    splits = problems_of(cfg)
    assert (len(splits.heldout), len(splits.train)) == (8, 20)
    assert [p.columns[VF_INDEX] for p in splits.heldout + splits.train] == list(range(28))
    first = splits.heldout[0]
    (message,) = first.prompt  # the task's prompt as the one user message an agent sends
    assert message["role"] == "user" and first.answer == str(eval(message["content"][8:].split(".")[0]))
    # Under the task's seed the taskset draws as spotrl's arithmetic does: its held-out tasks are the task's held-out
    # additions, which the tiny model's warm-up never sees.
    drawn = [p.prompt[0]["content"] for p in splits.heldout]
    assert drawn == [p.prompt for p in make_arithmetic(2, 1, 8, 1234).heldout]


def test_the_env_is_verifiers_single_agent_env_with_the_taskset_args_and_a_local_runtime():
    from verifiers.v1 import SingleAgentEnv

    env = load_env(_cfg(taskset_args={"num_tasks": 12}, episode_timeout_s=7.0).env.verifiers)
    assert isinstance(env, SingleAgentEnv) and len(list(env.taskset)) == 12
    assert env.config.timeout.episode == 7.0 and env.config.agent.runtime.type == "subprocess"


@pytest.mark.parametrize(
    "verifiers, field",
    [
        ({"taskset": "no_such_module_xyz:Taskset"}, "env.verifiers.taskset"),
        ({"taskset_args": {"num_tasks": "many"}}, "env.verifiers"),
        ({"taskset_args": {"num_tasks": 5}}, "env.verifiers.taskset"),  # too few for 8 held out and a train split
    ],
)
def test_a_taskset_that_cannot_run_is_a_config_error_at_start(verifiers, field):
    with pytest.raises(ConfigError, match=field):
        check_verifiers(_cfg(**verifiers))


def test_the_config_takes_one_environment_and_no_partial_rollouts_with_verifiers():
    with pytest.raises(ValueError, match="one environment, not several"):
        _cfg().model_validate(_cfg().model_dump() | {"env": {"name": "calculator", "verifiers": {"taskset": EXAMPLE}}})
    with pytest.raises(ValueError, match="rollout.partial_rollouts"):
        RunConfig.model_validate(_cfg().model_dump() | {"rollout": {"partial_rollouts": True}})
