"""The OpenEnv adapter's pure logic: OpenEnv's `StepResult` read as spotrl's `EnvStep`, the model's turn as the
library's Action, the causes of a lost episode, the config and its start-time checks. Served end to end:
tests/integration/test_openenv.py."""

import math

import pytest
from openenv.core.client_types import StepResult
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosedError

from app.tasks.environments import EnvLost, EnvStep
from app.tasks.openenv_env import (
    DISCONNECTED,
    MALFORMED,
    SERVER_ERROR,
    _lost,
    env_step,
    make_action,
    reset_kwargs,
    resolve_classes,
)
from app.tasks.problems import Problem
from core.config import ConfigError, load_config
from core.config.run import OpenEnvConfig
from examples.openenv_arithmetic import ArithmeticAction, ArithmeticObservation


def test_a_step_result_is_the_turns_reward_and_the_observations_text_read_next():
    assert env_step(StepResult({"message": " Add 7. Answer: "}, 0.5, False), "message") == EnvStep(
        0.5, observation=" Add 7. Answer: "
    )
    typed = StepResult(ArithmeticObservation(message=" Add 2. Answer: "), 1, False)  # a typed client's observation
    assert env_step(typed, "message") == EnvStep(1.0, observation=" Add 2. Answer: ")
    assert env_step(StepResult({}, None, True), "message") == EnvStep(0.0, done=True)  # done: nothing to read
    verdict = StepResult({}, 0.5, True, metadata={"solved": False})  # the environment's verdict, where it gives one
    assert env_step(verdict, "message") == EnvStep(0.5, done=True, solved=False)
    assert env_step(StepResult({}, 1.0, True, metadata={"solved": "yes"}), "message").solved is None


@pytest.mark.parametrize(
    "result",
    [
        StepResult({"message": 12}, 1.0, False),  # not text
        StepResult({"other": "x"}, 1.0, False),  # no such field
        StepResult({"message": "x"}, math.nan, False),
        StepResult({"message": "x"}, "1", False),
        StepResult({"message": "x"}, True, False),
        StepResult({"message": "x"}, 1.0, "yes"),
    ],
)
def test_garbage_is_a_malformed_answer(result):
    with pytest.raises(EnvLost) as lost:
        env_step(result, "message")
    assert lost.value.cause == MALFORMED


def test_the_models_turn_fills_the_actions_text_field():
    assert make_action("46", "message", None) == {"message": "46"}  # GenericEnvClient sends dicts
    action = make_action("46", "message", ArithmeticAction)
    assert isinstance(action, ArithmeticAction) and action.message == "46"


def test_reset_gets_the_problem_as_keywords():
    problem = Problem("p", "Compute 12+34. Answer: ", "46", {"chain": [7]})
    assert reset_kwargs(problem) == {"prompt": "Compute 12+34. Answer: ", "answer": "46", "chain": [7]}


def test_client_failures_are_named_by_cause():
    assert _lost(ConnectionClosedError(None, None)).cause == DISCONNECTED
    assert _lost(ConnectionError("Failed to connect to ws://127.0.0.1:9/ws")).cause == DISCONNECTED
    assert _lost(ConnectionRefusedError()).cause == DISCONNECTED
    assert _lost(RuntimeError("Server error: the environment broke (code: EXECUTION_ERROR)")).cause == SERVER_ERROR
    assert _lost(ValueError("Expecting value: line 1 column 1")).cause == MALFORMED
    assert _lost(TimeoutError()) is None  # a timeout is the runner's to count (step_timeout)
    assert _lost(RuntimeError("something else")) is None


def test_the_config_takes_a_url_or_an_app_and_resolves_the_librarys_classes():
    cfg = load_config(None, ["env.openenv.app=examples.openenv_arithmetic:app"])
    assert cfg.env.openenv.app == "examples.openenv_arithmetic:app" and cfg.env.multi_turn
    assert resolve_classes(cfg.env.openenv) == (GenericEnvClient, None)
    typed = OpenEnvConfig(url="http://127.0.0.1:8001", action="examples.openenv_arithmetic:ArithmeticAction")
    assert resolve_classes(typed) == (GenericEnvClient, ArithmeticAction)
    for bad in (
        ["env.openenv.url=http://127.0.0.1:1", "env.openenv.app=examples.openenv_arithmetic:app"],  # both
        ["env.openenv.action_field=message"],  # neither
        ["env.openenv.url=127.0.0.1:1"],
        ["env.openenv.app=examples.openenv_arithmetic"],
        ["env.openenv.url=http://127.0.0.1:1", "env.name=calculator"],
    ):
        with pytest.raises(ConfigError):
            load_config(None, bad)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["env.openenv.app=examples.nothing_here:app"], "env.openenv.app: app 'examples.nothing_here:app' cannot be"),
        (["env.openenv.app=examples.openenv_arithmetic:ArithmeticEnvironment.nope"], "env.openenv.app:"),
        (
            ["env.openenv.url=http://127.0.0.1:1", "env.openenv.client=examples.openenv_arithmetic:app"],
            "env.openenv.client:",
        ),
        (
            [
                "env.openenv.url=http://127.0.0.1:1",
                "env.openenv.action=examples.openenv_arithmetic:ArithmeticAction",
                "env.openenv.action_field=text",
            ],
            "env.openenv.action_field: examples.openenv_arithmetic:ArithmeticAction has no field 'text'",
        ),
    ],
)
def test_start_checks_name_the_field_in_one_line(overrides, says):
    from app.tasks.checks import check_names

    with pytest.raises(ConfigError) as refused:
        check_names(load_config(None, overrides))
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
