"""Nothing that `make train`, `make serve` or the tests start listens beyond loopback.

Each test starts the thing as its make target does, walks its whole process tree (the driver, Ray's
GCS, raylet, dashboard and agents, every worker, the vLLM engines under the replicas) and lists every
listening TCP socket with psutil: all must be on 127.0.0.1 (or ::1). A laptop on a shared network
running a training run must expose nothing; Ray's metrics endpoints, for one, answer anyone.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from deployments.replica.engine_watchdog import terminate
from tests.support.fleet_helpers import free_port, is_loopback, listening_sockets, process_tree

REPO = Path(__file__).resolve().parents[2]
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 directly, whatever the environment
# Processes of any Ray head, by command line: each must be seen listening, or the walk missed part of the run.
HEAD = (
    "gcs_server",
    "raylet/raylet",
    "dashboard/dashboard.py",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "autoscaler/_private/monitor.py",
)


def table(sockets) -> str:
    return "\n".join(f"  {ip}:{port}  pid {pid}  {name[:100]}" for ip, port, pid, name in sockets)


def assert_loopback_only(processes, must_include: tuple[str, ...], wait_s: float = 30.0) -> list:
    """Every listening socket of `processes` is on loopback; `must_include` proves the walk saw the run.

    Processes that start late (the autoscaler monitor opens its metrics port a while after the head is up,
    later still on a loaded machine) get `wait_s` to appear; a socket beyond loopback fails at once."""
    deadline = time.monotonic() + wait_s
    while True:
        sockets = listening_sockets(processes() if callable(processes) else processes)
        exposed = [s for s in sockets if not is_loopback(s[0])]
        assert not exposed, f"listening beyond loopback:\n{table(exposed)}\nall listening sockets:\n{table(sockets)}"
        seen = " ".join(name for *_, name in sockets)
        missing = [kind for kind in must_include if kind not in seen]
        if not missing:
            return sockets
        assert time.monotonic() < deadline, (
            f"no listening socket of {missing} found; the walk missed part of the run:\n{table(sockets)}"
        )
        time.sleep(1)


def test_s3_server_listens_on_loopback_only(tmp_path):
    from tests.support.s3_server import S3Server

    with S3Server(tmp_path / "s3") as s3:
        sockets = assert_loopback_only(process_tree(s3.pid), must_include=("weed",))
    assert {s3.base_port + offset for offset in range(4)} <= {port for _, port, *_ in sockets}


def test_make_train_listens_on_loopback_only(tmp_path, tiny_model_path):
    """`make train`'s embedded default: the driver's Ray (`start_ray(None)`) and a fleet (`deploy_fleet`),
    one replica instead of two (the same processes, one engine fewer)."""
    import ray

    from core.config import load_config
    from core.local_ray import start_ray
    from deployments.fleet import deploy_fleet

    cfg = load_config(
        None,
        [
            "fleet.num_replicas=1",
            f"fleet.port={free_port()}",
            f"bucket.url=file://{tmp_path}/bucket",
            f"bucket.cache_dir={tmp_path}/cache",
            "logging.run_name=loopback",
        ],
    )
    assert start_ray(None)
    try:
        deploy_fleet(cfg.own_fleet(), tiny_model_path, timeout_s=600)

        @ray.remote(num_cpus=0)
        class Actor:  # as the learner's ranks and the rollout actor are
            def ping(self) -> int:
                return os.getpid()

        actor = Actor.remote()
        ray.get(actor.ping.remote())
        assert_loopback_only(
            process_tree,  # this process is the driver: everything the run started descends from it
            must_include=(*HEAD, "ray::ServeController", "ray::ProxyActor", "ray::ServeReplica", "ray::Actor"),
        )
        engine = [p for p in process_tree() if "VLLM" in " ".join(p.cmdline())]
        assert engine, "no vLLM engine process under the replica"

        # Ray's Prometheus file-discovery config: the metrics endpoints it names are loopback ones too.
        discovery = (
            Path(ray._private.worker._global_node.get_session_dir_path()) / "prom_metrics_service_discovery.json"
        )
        deadline = time.monotonic() + 30
        while not discovery.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert discovery.exists(), f"Ray wrote no {discovery}"
        targets = [t for group in json.loads(discovery.read_text()) for t in group["targets"]]
        assert targets and all(is_loopback(t.rsplit(":", 1)[0].strip("[]")) for t in targets), targets
    finally:
        ray.shutdown()


RAY_START_TIMED_OUT = "The current node timed out during startup"


def _serve_config(path: Path, http_port: int) -> Path:
    path.write_text(
        "proxy_location: HeadOnly\n"
        f"http_options: {{host: 127.0.0.1, port: {http_port}}}\n"
        "applications:\n"
        "  - name: loopback\n"
        "    route_prefix: /\n"
        "    import_path: tests.support.loopback_app:app\n"
    )
    return path


def test_make_serve_head_listens_on_loopback_only(tmp_path):
    """`make serve` (`ops/serve_local.sh`): its `ray start --head`, then `serve run` of a one-replica app.

    Covers the head's processes (GCS, raylet, dashboard and its agent, runtime-env agent, autoscaler
    monitor, Ray client server, metrics export) and what `serve run` adds on it (the driver, Serve's
    controller, HTTP proxy and a replica); the fleet's vLLM engines are covered by the test above.
    It runs as on a machine where Ray never ran: a HOME without `~/.ray/auth_token`, which `ray start`
    with token auth refuses unless the script makes the token first."""
    home = tmp_path / "home"
    home.mkdir()
    marker = ("SPOTRL_LOOPBACK_PROBE", uuid.uuid4().hex)

    def launch(attempt: int) -> tuple[subprocess.Popen, int, Path]:
        http_port = free_port()
        env = {
            **os.environ,
            "RAY_ADDRESS": f"127.0.0.1:{free_port()}",
            "RAY_DASHBOARD_PORT": str(free_port()),
            "RAY_METRICS_EXPORT_PORT": str(free_port()),
            "RAY_CLIENT_SERVER_PORT": str(free_port()),
            marker[0]: marker[1],
            "HOME": str(home),
        }
        log = tmp_path / f"serve_local.{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["bash", "ops/serve_local.sh", str(_serve_config(tmp_path / "serve.yaml", http_port))],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, http_port, log

    attempt = 0
    proc, http_port, log = launch(attempt)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None and attempt == 0 and RAY_START_TIMED_OUT in log.read_text():
                # Ray gives a new raylet a fixed 30 s to register with its GCS, which a two-core CI machine still
                # busy ending the previous test's fleet can miss: what this test checks is where the head's
                # processes listen, so a second try on fresh ports (after stopping the first's) is fair.
                terminate([p.pid for p in process_tree(marker=marker)])
                attempt += 1
                proc, http_port, log = launch(attempt)
            assert proc.poll() is None, f"serve_local.sh ended early:\n{log.read_text()[-4000:]}"
            try:
                with NO_PROXY.open(f"http://127.0.0.1:{http_port}/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the app never answered:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        assert_loopback_only(
            lambda: process_tree(proc.pid, marker=marker),
            must_include=(
                *HEAD,
                "ray.util.client.server",
                "serve run",
                "ray::ServeController",
                "ray::ProxyActor",
                "ray::ServeReplica",
            ),
        )
        assert (home / ".ray" / "auth_token").is_file()  # made once, the way Ray documents it
    finally:
        # `make serve` leaves the head running: stop it (and `serve run`) by its processes, never `ray stop`,
        # which would stop every Ray of this machine.
        terminate([p.pid for p in process_tree(*([proc.pid] if proc.poll() is None else []), marker=marker)])
        proc.wait(10)
