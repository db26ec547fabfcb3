"""Start or join Ray for a run: the one place that decides what a Ray of ours listens on.

A Ray we start (`make train` without `--address`; `make serve`'s head, through the same settings in
ops/serve_local.sh; the tests' Rays) listens on 127.0.0.1 only, every process of it. Three
settings are needed, because Ray has no single switch:

1. Node address 127.0.0.1 *and* Ray's one-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read
   into `ray._private.ray_constants.ENABLE_RAY_CLUSTER`). Without the mode, `ray.init(_node_ip_address=
   "127.0.0.1")` swaps loopback for the machine's outward address (`services.resolve_ip_for_localhost`
   -> `get_node_ip_address`), and then the GCS, the raylet, every worker's gRPC server and the dashboard
   agent bind all interfaces, the runtime-env agent and the agent's HTTP port the outward address, and
   the monitor's and the dashboard's metrics ports 0.0.0.0: each binds loopback only when the node
   address is a loopback one (e.g. `dashboard/agent.py`: `get_localhost_ip() if is_localhost(self.ip)
   else get_all_interfaces_ip()`). Processes started later (workers) read the mode from the
   environment they inherit from the raylet.
2. `dashboard_host="127.0.0.1"` for the dashboard's own HTTP port (its default is also loopback).
3. Serve's per-replica gRPC server (`ray/serve/_private/replica.py`, `_on_initialized`) binds
   `[::]:0` whatever the node address. Every worker of our Ray imports this module at start-up (Ray's
   `preload_python_modules` system config), which binds that server to the node's loopback address
   instead: see `_bind_wildcards_to_loopback_node`.

A joined cluster (`--address`) is left as its operator configured it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

LOOPBACK = "127.0.0.1"
# No usage reports from a Ray of one machine, as `make serve`'s head (ops/serve_local.sh): Ray's dashboard would ask
# three clouds' metadata addresses (169.254.169.254, and metadata.google.internal through the machine's resolver) for
# its report and post it to usage-stats.ray.io; vLLM's GPU workers post theirs to stats.vllm.ai.
NO_USAGE_STATS_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "VLLM_NO_USAGE_STATS": "1"}
# Ray's one-machine mode: the node address stays 127.0.0.1 (`ray._private.services.get_node_ip_address`).
SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **NO_USAGE_STATS_ENV}
# Imported by every worker of our Ray before it runs anything (system config `preload_python_modules`, which the
# raylet passes to each worker as `--worker-preload-modules`; see ray/_private/workers/default_worker.py).
PRELOAD_MODULE = "core.local_ray"


def loopback_system_config() -> dict:
    """Ray `_system_config` entries of a loopback-only Ray (`ray start --system-config` takes the same as JSON)."""
    return {"preload_python_modules": [PRELOAD_MODULE]}


@contextmanager
def single_machine_mode():
    """Ray's one-machine mode, usage reports off, while a local Ray starts: for this process (the constant Ray read
    at import) and for the processes it spawns (GCS, raylet, agents; workers inherit from the raylet). Restored after,
    so that a later `ray.init(address=...)` of this process joins a cluster as usual."""
    import ray._private.ray_constants as ray_constants

    saved_env = {k: os.environ.get(k) for k in SINGLE_MACHINE_ENV}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(SINGLE_MACHINE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_ray(address: str | None, offline: bool = True) -> bool:
    """Join `address`, or start a loopback-only local Ray; True when we started it (so we stop it).

    `offline`: the model is a local folder, so no process of the run may reach a hub (a hub model's
    learner and replicas download it, at the pinned revision)."""
    import ray

    if address:
        ray.init(address=address)
        return False
    # Actor and replica logs stay in Ray's session folder (and the dashboard), so the terminal shows the run.
    with single_machine_mode():
        ray.init(
            address="local",
            num_cpus=max(8, os.cpu_count() or 1),
            include_dashboard=True,
            dashboard_host=LOOPBACK,
            _node_ip_address=LOOPBACK,
            _system_config=loopback_system_config(),
            log_to_driver=False,
            runtime_env={"env_vars": run_env_vars(offline)},
        )
    return True


def run_env_vars(offline: bool) -> dict[str, str]:
    """Environment of every process of a run we start."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if offline:
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


# ---- In every worker of a loopback-only Ray (imported through `preload_python_modules`) -------------------

_WILDCARDS = ("[::]", "::", "0.0.0.0", "[::0]", "")


def _loopback_node_ip() -> str | None:
    """This worker's node address when it is a loopback one (None elsewhere: a driver, a process without Ray)."""
    if "ray._private.worker" not in sys.modules:  # a Ray worker has it; anything else need not import Ray for this
        return None
    import ray._private.worker as ray_worker
    from ray._common.network_utils import is_localhost

    worker = ray_worker.global_worker
    if worker.mode != ray_worker.WORKER_MODE or ray_worker._global_node is None:
        return None
    ip = worker.node_ip_address
    return ip if ip and is_localhost(ip) else None


def _bind_wildcards_to_loopback_node() -> None:
    """Make `ray._common.tls_utils.add_port_to_grpc_server`, which Serve's replica calls with `[::]:0`, bind
    the node's loopback address instead of every interface. Clients reach a replica's gRPC server at the
    node address (127.0.0.1 here), so nothing that worked before stops working; TLS is kept as it was."""
    node_ip = _loopback_node_ip()
    if node_ip is None:
        return
    from ray._common import tls_utils

    original = tls_utils.add_port_to_grpc_server
    if getattr(original, "_spotrl_loopback", False):
        return
    host = f"[{node_ip}]" if ":" in node_ip else node_ip

    def add_port_to_grpc_server(server, address):
        wildcard, sep, port = str(address).rpartition(":")
        if sep and wildcard in _WILDCARDS:
            address = f"{host}:{port}"
        return original(server, address)

    add_port_to_grpc_server._spotrl_loopback = True
    tls_utils.add_port_to_grpc_server = add_port_to_grpc_server
    replica = sys.modules.get("ray.serve._private.replica")  # imported later, as a rule, with the patched name
    if replica is not None:
        replica.add_port_to_grpc_server = add_port_to_grpc_server


try:  # never let this break a worker's start-up: Ray only forgives an ImportError here
    _bind_wildcards_to_loopback_node()
except Exception:  # noqa: BLE001
    import logging

    logging.getLogger(__name__).exception("could not keep Serve's replica gRPC server on loopback")
