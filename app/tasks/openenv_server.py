"""An OpenEnv app served for a run: `env.openenv.app` (`module:app`) under uvicorn in the OpenEnv venv.

`OpenEnvServer` serves `env.openenv.app` (`module:app`) with uvicorn in the OpenEnv venv, on 127.0.0.1 and a free
port, for as long as the run holds it (`serve_openenv`, entered in the driver's ExitStack: stopped at the end and on
any failure). Both processes also end when the process that started them does (end of their stdin).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from app.tasks.openenv_env import WORKER, child_env, openenv_python

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OpenEnvServer:
    """`module:app` served by uvicorn in a child process of the OpenEnv venv on 127.0.0.1, from `start` (healthy)
    to `stop` (`openenv_worker.py --serve`: it also ends when its stdin does, so it never outlives the run)."""

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
        python = openenv_python()
        for attempt in range(3):  # the free port may be taken between finding it and binding it
            self.port = free_port(self.HOST)
            self._log = tempfile.TemporaryFile(mode="w+")
            cmd = [str(python), "-P", str(WORKER), "--serve", self.app, self.HOST, str(self.port)]
            self.process = subprocess.Popen(
                cmd,
                cwd=self.cwd,
                env=child_env(self.cwd),
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the driver, which stops it in order
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
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
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
