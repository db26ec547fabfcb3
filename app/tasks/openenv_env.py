"""OpenEnv environments (PyPI `openenv`) played as spotrl environments, through OpenEnv's own client, unchanged.

OpenEnv serves an environment over a WebSocket (`openenv.core.env_server.create_app`: one session, one environment
instance, per connection); its `EnvClient` speaks that protocol: `reset(**kwargs)` and `step(action)` answer a
`StepResult(observation, reward, done)`. `OpenEnvEnvironment` is a spotrl `Environment` (`app.tasks.environments`)
around one such client, one connection per episode, so the rollout's runner (`app.rollout.episodes`) plays it
token-exact like any other:

- `reset(problem)` opens a session and resets it with the problem as keywords (`prompt`, `answer` and the problem's
  columns; OpenEnv's server passes on only those the environment's `reset` accepts). The model's first turn answers
  the task's prompt, as for every spotrl environment; the reset's own observation is not shown.
- `step(text, token_ids)` sends the model's turn as the Action: a dict `{action_field: text}` for OpenEnv's
  `GenericEnvClient` (the default), or `action(**{action_field: text})` for a typed client's Action class. The
  observation's `observation_field` (text) is what the model reads next, tokenised once as every observation is;
  `StepResult.reward` is the turn's reward (None: 0) and `done` ends the episode; a last observation whose
  metadata says `solved` (a bool) gives the episode's verdict for held-out accuracy (else: a positive reward).
- `close()` closes the client, which ends the server's session.

What goes wrong costs the episode, never the run, each cause counted in `env/errors/<cause>` (`EnvLost`):
`openenv_disconnected` (the server went away, refused the connection, or closed it mid-episode),
`openenv_server_error` (the server answered an error frame: its environment raised, or refused the action),
`openenv_malformed` (an answer without the observation's text field, a reward that is not a finite number).
A call that hangs past `env.timeout_s` is the runner's `reset_timeout` / `step_timeout`; the client's own message
timeout is set just past it, so the abandoned thread and its socket end soon after.

`OpenEnvServer` serves `env.openenv.app` (`module:app`) with uvicorn on 127.0.0.1 and a free port, for as long as
the run holds it (`serve_openenv`, entered in the driver's ExitStack: stopped at the end and on any failure).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.tasks.environments import Environment, EnvLost, EnvStep
from app.tasks.problems import Problem
from app.tasks.registry import resolve_named

log = logging.getLogger(__name__)

DISCONNECTED, SERVER_ERROR, MALFORMED = "openenv_disconnected", "openenv_server_error", "openenv_malformed"
MESSAGE_TIMEOUT_MARGIN_S = 1.0  # past env.timeout_s: the runner gives up first, the client's socket soon after


def reset_kwargs(problem: Problem) -> dict[str, Any]:
    """The keywords of OpenEnv's `reset`: the problem's prompt, answer and columns (the server keeps the ones the
    environment's `reset` accepts)."""
    return {"prompt": problem.prompt, "answer": problem.answer, **problem.columns}


def make_action(text: str, field: str, action_cls: type | None) -> Any:
    """The model's turn as the environment's Action: its text in `field`."""
    if action_cls is None:
        return {field: text}
    return action_cls(**{field: text})


def env_step(result: Any, field: str) -> EnvStep:
    """An OpenEnv `StepResult` as spotrl's `EnvStep`: the observation's `field` (text) read next unless done.
    EnvLost('openenv_malformed') for an answer that is not one."""
    reward = 0.0 if result.reward is None else result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvLost(MALFORMED, f"the reward {result.reward!r} is not a finite number")
    if not isinstance(result.done, bool):
        raise EnvLost(MALFORMED, f"done is {result.done!r}, not a bool")
    if result.done:  # the episode's verdict, where the environment gives one (held-out accuracy): metadata's `solved`
        solved = (result.metadata or {}).get("solved") if isinstance(result.metadata, dict) else None
        return EnvStep(float(reward), done=True, solved=solved if isinstance(solved, bool) else None)
    observation = result.observation
    text = observation.get(field) if isinstance(observation, dict) else getattr(observation, field, None)
    if not isinstance(text, str):
        raise EnvLost(MALFORMED, f"the observation's {field!r} is {type(text).__name__}, not text: {observation!r}")
    return EnvStep(float(reward), observation=text)


def _lost(e: Exception) -> EnvLost | None:
    """The cause of a client failure, where it is the server's doing (None: let it be raised as it is)."""
    from websockets.exceptions import ConnectionClosed

    if isinstance(e, ConnectionClosed | ConnectionError | OSError) and not isinstance(e, TimeoutError):
        return EnvLost(DISCONNECTED, f"{type(e).__name__}: {e}")
    if isinstance(e, RuntimeError) and str(e).startswith("Server error"):  # EnvClient's error-frame message
        return EnvLost(SERVER_ERROR, str(e))
    if isinstance(e, ValueError | TypeError | KeyError):  # a frame that is not JSON, or not one EnvClient parses
        return EnvLost(MALFORMED, f"{type(e).__name__}: {e}")
    return None


class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv environment over one connection of its `EnvClient` (sync, as the runner's worker
    threads call it)."""

    def __init__(
        self,
        url: str,
        client_cls: type,
        *,
        action_cls: type | None = None,
        action_field: str = "message",
        observation_field: str = "message",
        timeout_s: float = 5.0,
    ):
        self.url, self.client_cls, self.action_cls = url, client_cls, action_cls
        self.action_field, self.observation_field = action_field, observation_field
        self.timeout_s = timeout_s
        self.client = None

    def _talk(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except EnvLost:
            raise
        except Exception as e:
            lost = _lost(e)
            if lost is None:
                raise
            raise lost from None

    def reset(self, problem: Problem) -> None:
        self.client = self.client_cls(
            base_url=self.url,
            connect_timeout_s=self.timeout_s,
            message_timeout_s=self.timeout_s + MESSAGE_TIMEOUT_MARGIN_S,
        ).sync()
        self._talk(self.client.connect)
        self._talk(lambda: self.client.reset(**reset_kwargs(problem)))

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        action = make_action(text, self.action_field, self.action_cls)
        result = self._talk(lambda: self.client.step(action))
        return env_step(result, self.observation_field)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a server that is gone already has nothing left to close
                client.close()


def resolve_classes(cfg) -> tuple[type, type | None]:
    """`env.openenv`'s client class (an `EnvClient`) and Action class (None: dicts); ValueError naming the field."""
    try:
        from openenv.core.env_client import EnvClient
        from openenv.core.env_server.types import Action
    except ImportError as e:
        raise ValueError(f"the openenv package is not installed ({e}): `make setup` installs the envs extra") from None
    client_cls = resolve_named(cfg.client, {}, "client", "module:Class")
    if not (isinstance(client_cls, type) and issubclass(client_cls, EnvClient)):
        raise ValueError(f"client: {cfg.client} is not an openenv EnvClient class")
    action_cls = None
    if cfg.action is not None:
        action_cls = resolve_named(cfg.action, {}, "action", "module:Class")
        if not (isinstance(action_cls, type) and issubclass(action_cls, Action)):
            raise ValueError(f"action: {cfg.action} is not an openenv Action class")
        if cfg.action_field not in action_cls.model_fields:
            raise ValueError(f"action_field: {cfg.action} has no field {cfg.action_field!r}")
    return client_cls, action_cls


def openenv_factory(cfg, timeout_s: float) -> Callable[[], OpenEnvEnvironment]:
    """A new `OpenEnvEnvironment` per episode, on `cfg.url` (the served app's, once `serve_openenv` started it)."""
    if cfg.url is None:
        raise ValueError("env.openenv.app is served by the driver (serve_openenv), which sets env.openenv.url")
    client_cls, action_cls = resolve_classes(cfg)
    return lambda: OpenEnvEnvironment(
        cfg.url,
        client_cls,
        action_cls=action_cls,
        action_field=cfg.action_field,
        observation_field=cfg.observation_field,
        timeout_s=timeout_s,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OpenEnvServer:
    """`module:app` served by uvicorn in a child process on 127.0.0.1, from `start` (healthy) to `stop`."""

    HOST = "127.0.0.1"

    def __init__(self, app: str, start_timeout_s: float = 180.0, cwd: str | Path | None = None):
        self.app, self.start_timeout_s = app, start_timeout_s
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.HOST}:{self.port}"

    def start(self) -> OpenEnvServer:
        for attempt in range(3):  # the free port may be taken between finding it and binding it
            self.port = free_port(self.HOST)
            self._log = tempfile.TemporaryFile(mode="w+")
            env = dict(os.environ)  # the run's modules (the app's) importable from the child as from the driver
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.cwd), env.get("PYTHONPATH")) if p)
            cmd = [sys.executable, "-m", "uvicorn", self.app, "--host", self.HOST, "--port", str(self.port)]
            cmd += ["--log-level", "warning", "--ws-ping-interval", "20", "--ws-ping-timeout", "20"]
            self.process = subprocess.Popen(
                cmd, cwd=self.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )
            if self._wait_healthy():
                log.info("OpenEnv app %s serving on %s (pid %d)", self.app, self.url, self.process.pid)
                return self
            output = self._output()
            self.stop()
            if "address already in use" not in output.lower() or attempt == 2:
                raise RuntimeError(f"the OpenEnv app {self.app} did not start on {self.HOST}: {output[-2000:]}")
        raise AssertionError("unreachable")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def _output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> OpenEnvServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_openenv(stack: ExitStack, cfg):
    """The run's config, with `env.openenv.app` served for as long as `stack` lives (its url set in the config the
    rollout and the evaluation get); the config as it is when there is nothing to serve."""
    oe = cfg.env.openenv
    if oe is None or oe.app is None:
        return cfg
    server = stack.enter_context(OpenEnvServer(oe.app, oe.start_timeout_s))
    served = oe.model_copy(update={"url": server.url, "app": None})
    return cfg.model_copy(update={"env": cfg.env.model_copy(update={"openenv": served})})
