"""The OpenEnv adapter's pure logic: a step's answer (OpenEnv's `StepResult` as the worker sends it) read as spotrl's
`EnvStep`, the causes of a lost episode from the client's exception, the problem as reset's keywords, the config, and
the one-line error of a run without the OpenEnv venv. Nothing here imports openenv (it lives in its own venv); the
worker, the servers and the faults run in tests/integration/test_openenv.py."""

import math

import pytest

from app.tasks import openenv_env, openenv_server
from app.tasks.environments import EnvLost, EnvStep
from app.tasks.openenv_env import (
    DISCONNECTED,
    MALFORMED,
    SERVER_ERROR,
    child_env,
    env_step,
    failure,
    reset_kwargs,
)
from app.tasks.problems import Problem
from core.config import ConfigError, load_config


def answer(observation=None, reward=None, done=False, metadata=None) -> dict:
    """A step's answer as the worker writes it (`openenv_worker.result_dict`)."""
    return {"observation": observation or {}, "reward": reward, "done": done, "metadata": metadata}


def test_a_step_result_is_the_turns_reward_and_the_observations_text_read_next():
    assert env_step(answer({"message": " Add 7. Answer: "}, 0.5), "message") == EnvStep(
        0.5, observation=" Add 7. Answer: "
    )
    typed = answer({"message": " Add 2. Answer: ", "metadata": {}}, 1)  # a typed Observation, serialised
    assert env_step(typed, "message") == EnvStep(1.0, observation=" Add 2. Answer: ")
    assert env_step(answer(None, None, True), "message") == EnvStep(0.0, done=True)  # done: nothing to read
    verdict = answer({}, 0.5, True, {"solved": False})  # the environment's verdict, where it gives one
    assert env_step(verdict, "message") == EnvStep(0.5, done=True, solved=False)
    assert env_step(answer({}, 1.0, True, {"solved": "yes"}), "message").solved is None


@pytest.mark.parametrize(
    "result",
    [
        answer({"message": 12}, 1.0),  # not text
        answer({"other": "x"}, 1.0),  # no such field
        answer({"message": "x"}, "nan"),  # the worker's word for a NaN reward
        answer({"message": "x"}, math.inf),
        answer({"message": "x"}, "1"),
        answer({"message": "x"}, True),
        answer({"message": "x"}, 1.0, "yes"),
        answer("not a dict", 1.0),
        ["not", "a", "result"],
    ],
)
def test_garbage_is_a_malformed_answer(result):
    with pytest.raises(EnvLost) as lost:
        env_step(result, "message")
    assert lost.value.cause == MALFORMED


def test_reset_gets_the_problem_as_keywords():
    problem = Problem("p", "Compute 12+34. Answer: ", "46", {"chain": [7]})
    assert reset_kwargs(problem) == {"prompt": "Compute 12+34. Answer: ", "answer": "46", "chain": [7]}


def kinds(*names: str) -> list[str]:
    return [*names, "Exception", "BaseException", "object"]


@pytest.mark.parametrize(
    "error, cause",
    [
        (
            {"kinds": kinds("ConnectionClosedError", "ConnectionClosed", "WebSocketException"), "message": ""},
            DISCONNECTED,
        ),
        (
            {"kinds": kinds("ConnectionError", "OSError"), "message": "Failed to connect to ws://127.0.0.1:9/ws"},
            DISCONNECTED,
        ),
        ({"kinds": kinds("ConnectionRefusedError", "ConnectionError", "OSError"), "message": ""}, DISCONNECTED),
        ({"kinds": kinds("RuntimeError"), "message": "Server error: it broke (code: EXECUTION_ERROR)"}, SERVER_ERROR),
        ({"kinds": kinds("JSONDecodeError", "ValueError"), "message": "Expecting value: line 1 column 1"}, MALFORMED),
        ({"kinds": kinds("KeyError", "LookupError"), "message": "'observation'"}, MALFORMED),
        ({"kinds": kinds("ValidationError", "ValueError"), "message": "1 validation error"}, MALFORMED),
    ],
)
def test_client_failures_are_named_by_cause(error, cause):
    lost = failure(error)
    assert isinstance(lost, EnvLost) and lost.cause == cause


def test_a_client_timeout_is_the_runners_and_anything_else_is_raised_as_itself():
    assert isinstance(failure({"kinds": kinds("TimeoutError", "OSError"), "message": ""}), TimeoutError)
    other = failure({"kinds": kinds("RuntimeError"), "message": "something else"})
    assert type(other) is RuntimeError and "something else" in str(other)
    assert type(failure({})) is RuntimeError  # an error without kinds is still one


def test_the_openenv_processes_import_from_the_working_folder_and_the_repository_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/the/runs/venv/lib/python3.11/site-packages")
    monkeypatch.setenv("VIRTUAL_ENV", "/the/runs/venv")
    env = child_env(tmp_path)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path), str(openenv_env.REPO)]  # not the run's packages
    assert "VIRTUAL_ENV" not in env


def test_the_config_takes_a_url_or_an_app():
    cfg = load_config(None, ["env.openenv.app=examples.openenv_arithmetic:app"])
    assert cfg.env.openenv.app == "examples.openenv_arithmetic:app" and cfg.env.kind == "openenv"
    assert cfg.env.openenv.client == "openenv.core.generic_client:GenericEnvClient"
    for bad in (
        ["env.openenv.url=http://127.0.0.1:1", "env.openenv.app=examples.openenv_arithmetic:app"],  # both
        ["env.openenv.action_field=message"],  # neither
        ["env.openenv.url=127.0.0.1:1"],
        ["env.openenv.app=examples.openenv_arithmetic"],
        ["env.openenv.url=http://127.0.0.1:1", "env.name=calculator"],
    ):
        with pytest.raises(ConfigError):
            load_config(None, bad)


def test_a_run_without_the_openenv_venv_is_refused_at_start_in_one_line_saying_what_builds_it(tmp_path, monkeypatch):
    from app.tasks.checks import check_names

    monkeypatch.setattr(openenv_env, "OPENENV_VENV", tmp_path / ".venv-openenv")
    with pytest.raises(ConfigError) as refused:
        check_names(load_config(None, ["env.openenv.url=http://127.0.0.1:1"]))
    said = str(refused.value)
    assert said.startswith("env.openenv: the OpenEnv venv") and "`make setup` builds it" in said and "\n" not in said
    with pytest.raises(ValueError, match="make setup"):
        openenv_server.OpenEnvServer("examples.openenv_arithmetic:app").start()  # nothing started either
