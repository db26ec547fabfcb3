"""OpenEnv's own `EnvClient`, unchanged, in a process of the OpenEnv venv (`.venv-openenv`), driven over stdin/stdout.

Why a process: openenv's package imports its server side (fastmcp 3, which needs mcp<2) even for the client, and the
run's venv holds vLLM 0.32 (mcp>=2) and verifiers (mcp==2.0.0): no one set of packages holds both. So the rollout
(`app.tasks.openenv_env`) starts this module with the OpenEnv venv's python and speaks JSON lines with it. It imports
only the standard library and openenv (and the config's client and Action classes), never spotrl.

    python app/tasks/openenv_worker.py '{"url": ..., "client": "module:Class", "action": null, "action_field": ...,
                                         "connect_timeout_s": 5, "message_timeout_s": 6}'

First line out: `{"ready": {"openenv": version}}`, or `{"config_error": "<field>: why"}` and exit 2. Then one line in
per request, one line out per answer, matched by `id` (answers come in any order: sessions run concurrently):

    {"id": 1, "op": "reset", "session": "a", "kwargs": {...}}      -> {"id": 1, "result": {observation, reward, ...}}
    {"id": 2, "op": "step", "session": "a", "action": {"message": "46"}}  -> the same
    {"id": 3, "op": "close", "session": "a"}                         -> {"id": 3, "result": null}

A session is one `EnvClient` (one WebSocket, one environment on the server), opened by its reset. An observation is
sent as a dict: a typed client's Observation as the library serialises it (`serialize_observation`), a generic
client's as it came. A failure answers `{"id": n, "error": {"kinds": [the exception's classes, most derived first],
"message": ...}}`, which the rollout reads as the episode's cause. With `--check`, the config's classes (and `app`)
are resolved, one line says so, and the worker exits. At end of input (the rollout closed it, or died) every session
is closed and the worker exits, so it never outlives the process that started it.

With `--serve module:app HOST PORT` it serves an OpenEnv app instead, with uvicorn (openenv's own server dependency),
until SIGTERM or the end of its stdin (`app.tasks.openenv_server.OpenEnvServer`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import signal
import sys
import threading
from typing import Any


def resolve(path: str, field: str) -> Any:
    """`module:attr` imported; ValueError starting with the field else."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # an import that fails for any reason is the config's error, said in one line
        raise ValueError(f"{field}: {path} cannot be imported ({type(e).__name__}: {e})") from None
    return obj


def resolve_config(cfg: dict) -> tuple[type, type | None]:
    """The config's EnvClient class and Action class (None: dicts), checked against openenv's bases."""
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.types import Action

    client_cls = resolve(cfg["client"], "client")
    if not (isinstance(client_cls, type) and issubclass(client_cls, EnvClient)):
        raise ValueError(f"client: {cfg['client']} is not an openenv EnvClient class")
    action_cls = None
    if cfg.get("action"):
        action_cls = resolve(cfg["action"], "action")
        if not (isinstance(action_cls, type) and issubclass(action_cls, Action)):
            raise ValueError(f"action: {cfg['action']} is not an openenv Action class")
        if cfg["action_field"] not in action_cls.model_fields:
            raise ValueError(f"action_field: {cfg['action']} has no field {cfg['action_field']!r}")
    if cfg.get("app"):
        app = resolve(cfg["app"], "app")
        if not callable(app):
            raise ValueError(f"app: {cfg['app']} is not an ASGI app (OpenEnv's create_app builds one)")
    return client_cls, action_cls


def result_dict(result: Any) -> dict:
    """A `StepResult` as JSON-able data: the observation by the library's own serialisation where it is a model."""
    from openenv.core.env_server.serialization import serialize_observation
    from openenv.core.env_server.types import Observation

    observation = result.observation
    if isinstance(observation, Observation):
        observation = serialize_observation(observation)["observation"]
    reward = result.reward
    if isinstance(reward, float) and not math.isfinite(reward):
        reward = repr(reward)  # JSON has no NaN; the rollout refuses a reward that is not a number all the same
    return {"observation": observation, "reward": reward, "done": result.done, "metadata": result.metadata}


def error_dict(e: BaseException) -> dict:
    return {"kinds": [c.__name__ for c in type(e).__mro__], "message": str(e)}


class Worker:
    def __init__(self, cfg: dict, client_cls: type, action_cls: type | None, out):
        self.cfg, self.client_cls, self.action_cls, self.out = cfg, client_cls, action_cls, out
        self.clients: dict[str, Any] = {}
        self.busy: dict[str, asyncio.Task] = {}  # each session's call in progress, cancelled by its close

    def send(self, message: dict) -> None:
        try:
            line = json.dumps(message, allow_nan=False)
        except (TypeError, ValueError) as e:  # an observation that is not JSON: the answer is malformed
            line = json.dumps({"id": message.get("id"), "error": error_dict(e)})
        self.out.write(line + "\n")
        self.out.flush()

    async def open(self, session: str) -> Any:
        client = self.client_cls(
            base_url=self.cfg["url"],
            connect_timeout_s=self.cfg["connect_timeout_s"],
            message_timeout_s=self.cfg["message_timeout_s"],
        )
        self.clients[session] = client
        await client.connect()
        return client

    async def call(self, request: dict) -> Any:
        session, op = request["session"], request["op"]
        if op == "reset":
            await self.drop(session)  # a session reset again starts on a new connection
            client = await self.open(session)
            return result_dict(await client.reset(**request.get("kwargs", {})))
        if op == "step":
            client = self.clients.get(session)
            if client is None:
                raise KeyError(f"no session {session!r}: reset it first")
            action = request["action"]
            if self.action_cls is not None:
                action = self.action_cls(**action)
            return result_dict(await client.step(action))
        raise ValueError(f"unknown op {op!r}")

    async def close(self, session: str) -> None:
        """The session's call in progress cancelled (the rollout gave up on it), its connection closed."""
        task = self.busy.pop(session, None)
        if task is not None:
            task.cancel()
        await self.drop(session)

    async def drop(self, session: str) -> None:
        client = self.clients.pop(session, None)
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - a server that is gone has nothing left to close
                pass

    async def handle(self, request: dict) -> None:
        rid = request.get("id")
        try:
            if request.get("op") == "close":
                await self.close(request["session"])
                self.send({"id": rid, "result": None})
                return
            task = asyncio.ensure_future(self.call(request))
            self.busy[request["session"]] = task
            try:
                result = await task
            finally:
                if self.busy.get(request["session"]) is task:
                    del self.busy[request["session"]]
            self.send({"id": rid, "result": result})
        except asyncio.CancelledError:
            self.send({"id": rid, "error": {"kinds": ["CancelledError"], "message": "closed while in progress"}})
        except Exception as e:  # noqa: BLE001 - whatever the client raised is the episode's, named by its kinds
            self.send({"id": rid, "error": error_dict(e)})

    async def serve(self, reader: asyncio.StreamReader) -> None:
        handlers: set[asyncio.Task] = set()
        while line := await reader.readline():
            try:
                request = json.loads(line)
            except ValueError as e:
                self.send({"id": None, "error": error_dict(e)})
                continue
            task = asyncio.ensure_future(self.handle(request))
            handlers.add(task)
            task.add_done_callback(handlers.discard)
        # End of input: the rollout is done with us (or gone). Let every session go, then exit.
        for task in list(handlers):
            task.cancel()
        await asyncio.wait_for(asyncio.gather(*(self.close(s) for s in list(self.clients)), return_exceptions=True), 10)


async def main(cfg: dict, client_cls: type, action_cls: type | None, out) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), sys.stdin)
    worker = Worker(cfg, client_cls, action_cls, out)
    worker.send({"ready": {"openenv": openenv_version()}})
    await worker.serve(reader)


def openenv_version() -> str:
    from importlib.metadata import version

    return version("openenv")


def serve(app: str, host: str, port: str) -> int:
    """`module:app` served by uvicorn (openenv's server's own) until SIGTERM or the end of stdin: the process that
    started it stops it, or its death does."""
    import uvicorn

    def exit_at_end_of_input() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's own graceful shutdown

    threading.Thread(target=exit_at_end_of_input, daemon=True).start()
    uvicorn.run(
        app,
        host=host,
        port=int(port),
        log_level="warning",
        ws_ping_interval=20,
        ws_ping_timeout=20,
        timeout_graceful_shutdown=5,
    )
    return 0


def run(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve(*argv[1:4])
    # The answers own the real stdout; anything else printed (a user's module, a library) goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    check = "--check" in argv
    cfg = json.loads(next(a for a in argv if a != "--check"))
    try:
        client_cls, action_cls = resolve_config(cfg)
    except ValueError as e:
        out.write(json.dumps({"config_error": str(e)}) + "\n")
        out.flush()
        return 2
    if check:
        out.write(json.dumps({"ready": {"openenv": openenv_version()}}) + "\n")
        out.flush()
        return 0
    try:
        asyncio.run(main(cfg, client_cls, action_cls, out))
    except (TimeoutError, KeyboardInterrupt):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
