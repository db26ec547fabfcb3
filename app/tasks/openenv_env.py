"""OpenEnv environments (PyPI `openenv`) played as spotrl environments, through OpenEnv's own client, unchanged.

OpenEnv lives in a venv of its own, `.venv-openenv` (`make setup` builds it from requirements-openenv.txt): openenv's
package imports its server side, fastmcp 3 (mcp<2), even for the client, while the run's venv holds vLLM 0.32
(mcp>=2) and verifiers 0.4 (mcp==2.0.0), and no one set of packages holds both. So nothing of openenv is imported
here. The run talks to an OpenEnv server through `app/tasks/openenv_worker.py`: OpenEnv's `EnvClient` in a process of
that venv, driven by JSON lines over its stdin/stdout (one per run's sampler: `OpenEnvSessions`). What the rollout
needs stays here: the timeouts, the causes of a lost episode, the processes' lifecycle.

OpenEnv serves an environment over a WebSocket (`create_app`: one session, one environment instance, per
connection). `OpenEnvEnvironment` is a spotrl `Environment` (`app.tasks.environments`) over one such session, so the
rollout's runner (`app.rollout.episodes`) plays it token-exact like any other (an app the run serves itself:
`app.tasks.openenv_server`):

- `reset(problem)` opens a session and resets it with the problem as keywords (`prompt`, `answer` and the problem's
  columns; OpenEnv's server passes on only those the environment's `reset` accepts). The model's first turn answers
  the task's prompt, as for every spotrl environment; the reset's own observation is not shown.
- `step(text, token_ids)` sends the model's turn as the Action: `{action_field: text}`, sent as a dict by OpenEnv's
  `GenericEnvClient` (the default) or built into the config's Action class. The observation's `observation_field`
  (text) is what the model reads next; the step's reward is the turn's (None: 0) and `done` ends the episode; a
  last observation whose metadata says `solved` (a bool) gives the episode's verdict for held-out accuracy.
- `close()` closes the session (its connection, and the server's environment).

What goes wrong costs the episode, never the run, each cause counted in `env/errors/<cause>` (`EnvLost`):
`openenv_disconnected` (the server went away, refused the connection, or closed it mid-episode),
`openenv_server_error` (the server answered an error frame: its environment raised, or refused the action),
`openenv_malformed` (an answer that is not JSON, lacks the observation's text, or has a reward that is not a finite
number), `openenv_worker_lost` (the worker process died; the next episode starts a new one). A call that hangs past
`env.timeout_s` is the runner's `reset_timeout` / `step_timeout`; the client's own message timeout is set just past
it, so the abandoned session's socket ends soon after, and the runner closes the session.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from app.tasks.environments import Environment, EnvLost, EnvStep
from app.tasks.problems import Problem

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
OPENENV_VENV = REPO / ".venv-openenv"
WORKER = Path(__file__).with_name("openenv_worker.py")
DISCONNECTED, SERVER_ERROR, MALFORMED = "openenv_disconnected", "openenv_server_error", "openenv_malformed"
WORKER_LOST = "openenv_worker_lost"
MESSAGE_TIMEOUT_MARGIN_S = 1.0  # past env.timeout_s: the runner gives up first, the client's socket soon after


def openenv_python() -> Path:
    """The OpenEnv venv's python; ValueError (one line, saying what builds it) where there is none."""
    python = OPENENV_VENV / "bin" / "python"
    if not python.exists():
        raise ValueError(
            f"the OpenEnv venv {OPENENV_VENV} is missing: `make setup` builds it "
            "(openenv has a venv of its own: its mcp<2 cannot share one with vLLM's mcp>=2)"
        )
    return python


def child_env(cwd: Path) -> dict[str, str]:
    """The environment of a process of the OpenEnv venv: the config's modules (the app's, the client's) importable
    from `cwd` and the repository. The run's own PYTHONPATH is not passed on: an entry of it holding the run's
    packages (a Ray worker's may) would come before the venv's and bring back the mcp the venv exists to avoid."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join((str(cwd), str(REPO)))
    env.pop("VIRTUAL_ENV", None)  # the run's venv is not this process's
    return env


def worker_config(cfg, timeout_s: float) -> dict[str, Any]:
    """What the worker is started with (`app/tasks/openenv_worker.py`)."""
    return {
        "url": cfg.url,
        "client": cfg.client,
        "action": cfg.action,
        "action_field": cfg.action_field,
        "app": None,
        "connect_timeout_s": timeout_s,
        "message_timeout_s": timeout_s + MESSAGE_TIMEOUT_MARGIN_S,
    }


def check_classes(cfg, cwd: Path | None = None, timeout_s: float = 300.0) -> str:
    """The config's client and Action classes (and app) resolved in the OpenEnv venv, as the worker will: its openenv
    version; ValueError whose message starts with the field (`client: ...`) else."""
    python = openenv_python()
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    config = {**worker_config(cfg, 1.0), "app": cfg.app}
    done = subprocess.run(
        [str(python), "-P", str(WORKER), "--check", json.dumps(config)],
        cwd=cwd,
        env=child_env(cwd),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ValueError(f"the OpenEnv worker did not start: {done.stderr.strip()[-500:]}") from None
    if "config_error" in answer:
        raise ValueError(answer["config_error"])
    return answer["ready"]["openenv"]


def reset_kwargs(problem: Problem) -> dict[str, Any]:
    """The keywords of OpenEnv's `reset`: the problem's prompt, answer and columns (the server keeps the ones the
    environment's `reset` accepts)."""
    return {"prompt": problem.prompt, "answer": problem.answer, **problem.columns}


def env_step(result: dict, field: str) -> EnvStep:
    """A step's answer (the worker's dict of OpenEnv's `StepResult`) as spotrl's `EnvStep`: the observation's `field`
    (text) read next unless done. EnvLost('openenv_malformed') for an answer that is not one."""
    if not isinstance(result, dict):
        raise EnvLost(MALFORMED, f"the answer {result!r} is not a step's result")
    reward = 0.0 if result.get("reward") is None else result["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvLost(MALFORMED, f"the reward {result.get('reward')!r} is not a finite number")
    done = result.get("done", False)
    if not isinstance(done, bool):
        raise EnvLost(MALFORMED, f"done is {done!r}, not a bool")
    observation = result.get("observation")
    if done:  # the episode's verdict, where the environment gives one (held-out accuracy): metadata's `solved`
        metadata = result.get("metadata")
        solved = metadata.get("solved") if isinstance(metadata, dict) else None
        return EnvStep(float(reward), done=True, solved=solved if isinstance(solved, bool) else None)
    text = observation.get(field) if isinstance(observation, dict) else None
    if not isinstance(text, str):
        raise EnvLost(MALFORMED, f"the observation's {field!r} is {type(text).__name__}, not text: {observation!r}")
    return EnvStep(float(reward), observation=text)


def failure(error: dict) -> Exception:
    """What the worker's error (the client's exception: its classes, most derived first, and message) costs: an
    EnvLost naming the cause, TimeoutError for the client's own timeout (the runner's to count), else RuntimeError."""
    kinds, message = set(error.get("kinds") or ()), str(error.get("message", ""))
    said = f"{(error.get('kinds') or ['?'])[0]}: {message}"
    if "TimeoutError" in kinds:
        return TimeoutError(said)
    if kinds & {"ConnectionClosed", "ConnectionError", "OSError", "InvalidHandshake", "InvalidURI"}:
        return EnvLost(DISCONNECTED, said)
    if "RuntimeError" in kinds and message.startswith("Server error"):  # EnvClient's error-frame message
        return EnvLost(SERVER_ERROR, message)
    if kinds & {"ValueError", "TypeError", "KeyError", "ValidationError"}:  # not JSON, or not a StepResult
        return EnvLost(MALFORMED, said)
    return RuntimeError(said)


class OpenEnvWorker:
    """One process of `app/tasks/openenv_worker.py` in the OpenEnv venv: requests written as JSON lines, each
    answered by a Future; a reader thread matches the answers. A worker that died fails its requests
    (`openenv_worker_lost`) and the next request starts another."""

    def __init__(self, config: dict, start_timeout_s: float = 180.0, cwd: Path | None = None):
        self.config, self.start_timeout_s = config, start_timeout_s
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.process: subprocess.Popen | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()  # one writer; pending and process changed together
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._closed = False
        self.started = 0  # workers started so far: the sessions of one die with it

    def start(self) -> OpenEnvWorker:
        python = openenv_python()
        with self._lock:
            self._start(python)
        return self

    def _start(self, python: Path) -> None:
        process = subprocess.Popen(
            [str(python), "-P", str(WORKER), json.dumps(self.config)],
            cwd=self.cwd,
            env=child_env(self.cwd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        threading.Thread(target=self._drain_stderr, args=(process,), daemon=True, name="openenv-stderr").start()
        ready: Future = Future()
        pending: dict[int, Future] = {}  # this process's requests: they die with it, whatever starts after
        threading.Thread(target=self._read, args=(process, ready, pending), daemon=True, name="openenv-answers").start()
        try:
            first = ready.result(timeout=self.start_timeout_s)
        except Exception:
            self._kill(process)
            raise RuntimeError(f"the OpenEnv worker did not start: {self.stderr_tail()}") from None
        if "config_error" in first:
            self._kill(process)
            raise ValueError(first["config_error"])
        self.process, self._pending = process, pending
        self.started += 1
        log.info(
            "OpenEnv worker (openenv %s) pid %d for %s", first["ready"]["openenv"], process.pid, self.config["url"]
        )

    def _drain_stderr(self, process: subprocess.Popen) -> None:
        for line in process.stderr:
            self._stderr.append(line.rstrip())
            log.warning("openenv worker: %s", line.rstrip())

    def stderr_tail(self) -> str:
        return " | ".join(list(self._stderr)[-8:])[-1500:]

    def _read(self, process: subprocess.Popen, ready: Future, pending: dict[int, Future]) -> None:
        for line in process.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                log.warning("the OpenEnv worker wrote a line that is not JSON: %.200s", line)
                continue
            if not ready.done():
                ready.set_result(answer)
                continue
            with self._lock:
                future = pending.pop(answer.get("id"), None)
            if future is None:
                continue  # an answer no one waits for any more (its call timed out)
            if "error" in answer:
                future.set_exception(failure(answer["error"]))
            else:
                future.set_result(answer.get("result"))
        # End of its output: the worker exited. Whatever it had not answered is lost with it.
        process.wait()
        if not ready.done():
            ready.set_exception(RuntimeError("exited"))
        with self._lock:
            if self.process is process:
                self.process = None
            lost = dict(pending)
            pending.clear()
        why = f"the OpenEnv worker exited (rc {process.returncode}): {self.stderr_tail()}"
        if lost and not self._closed:
            log.warning("%s; %d calls lost", why, len(lost))
        for future in lost.values():
            future.set_exception(EnvLost(WORKER_LOST, why))

    def request(self, op: str, session: str, started: int | None = None, **fields) -> tuple[Future, int]:
        """Send one request; its answer comes in the Future (a result dict, or the failure it costs), with the number
        of the worker that got it. A session's later requests name the worker its reset went to (`started`): one
        that has died since took the session with it (`openenv_worker_lost`); a reset starts a new worker if need be."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise EnvLost(WORKER_LOST, "the OpenEnv worker is closed")
            alive = self.process is not None and self.process.poll() is None
            if started is not None and (started != self.started or not alive):
                raise EnvLost(WORKER_LOST, f"the OpenEnv worker that held this session exited: {self.stderr_tail()}")
            if not alive:
                self._start(openenv_python())  # it died: a new one for the episodes to come
            rid = next(self._ids)
            self._pending[rid] = future
            try:
                self.process.stdin.write(json.dumps({"id": rid, "op": op, "session": session, **fields}) + "\n")
                self.process.stdin.flush()
            except (OSError, ValueError) as e:  # its pipe is gone: the reader fails the rest
                self._pending.pop(rid, None)
                raise EnvLost(WORKER_LOST, f"the OpenEnv worker's input is closed ({e})") from None
            return future, self.started

    def call(self, op: str, session: str, timeout_s: float, started: int | None = None, **fields) -> tuple[Any, int]:
        """The answer to one request within `timeout_s` (TimeoutError else), with the number of the worker."""
        future, worker = self.request(op, session, started, **fields)
        try:
            return future.result(timeout=timeout_s), worker
        except TimeoutError:
            raise TimeoutError(f"OpenEnv {op} took over {timeout_s:.1f} s") from None

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        with contextlib.suppress(OSError):
            process.stdin.close()  # end of input: the worker closes its sessions and exits
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        """End of its input (it closes its sessions and exits), killed if it has not within 15 s; idempotent."""
        with self._lock:
            self._closed = True
            process, self.process = self.process, None
        if process is not None:
            self._kill(process)


class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv environment: one session of the worker's (sync, as the runner's threads call it)."""

    _sessions = itertools.count(1)

    def __init__(self, worker: OpenEnvWorker, action_field: str, observation_field: str, timeout_s: float):
        self.worker, self.action_field, self.observation_field = worker, action_field, observation_field
        # Past the client's own message timeout: the runner gives up at timeout_s, the worker's answer comes after.
        self.wait_s = timeout_s + 2 * MESSAGE_TIMEOUT_MARGIN_S
        self.session = f"s{next(self._sessions)}"
        self.worker_started: int | None = None  # the worker that holds the session, from its reset on

    def reset(self, problem: Problem) -> None:
        kwargs = reset_kwargs(problem)
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the problem's columns are not JSON, which OpenEnv's reset takes: {e}") from None
        future, self.worker_started = self.worker.request("reset", self.session, kwargs=kwargs)
        try:
            future.result(timeout=self.wait_s)
        except TimeoutError:
            raise TimeoutError(f"OpenEnv reset took over {self.wait_s:.1f} s") from None

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        if self.worker_started is None:
            raise RuntimeError("step() before reset()")
        result, _ = self.worker.call(
            "step", self.session, self.wait_s, self.worker_started, action={self.action_field: text}
        )
        return env_step(result, self.observation_field)

    def close(self) -> None:
        started, self.worker_started = self.worker_started, None
        if started is None:
            return
        with contextlib.suppress(Exception):  # a session on a server or worker that is gone has nothing to close
            self.worker.call("close", self.session, self.wait_s, started)


class OpenEnvSessions:
    """The runner's environment factory for `env.openenv`: a new `OpenEnvEnvironment` per episode, all sessions of
    one worker, which `close` stops (the runner closes it with itself)."""

    def __init__(self, cfg, timeout_s: float):
        if cfg.url is None:
            raise ValueError("env.openenv.app is served by the driver (serve_openenv), which sets env.openenv.url")
        self.cfg, self.timeout_s = cfg, timeout_s
        self.worker = OpenEnvWorker(worker_config(cfg, timeout_s), cfg.start_timeout_s).start()

    def __call__(self) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self.worker, self.cfg.action_field, self.cfg.observation_field, self.timeout_s)

    def close(self) -> None:
        self.worker.close()


def openenv_factory(cfg, timeout_s: float) -> OpenEnvSessions:
    """The environments of `cfg` (`env.openenv`, its url set: a server running, or the one `serve_openenv` started)."""
    return OpenEnvSessions(cfg, timeout_s)
