"""A replica's vLLM engines do not outlive it, even when Ray itself is killed (`ray stop --force`).

`ray.kill` of a replica is cleaned up by the raylet, which ends the worker's process group; but when the
raylet dies too (`ray stop --force`, a node agent killed), the engine processes are re-parented to init
and keep their memory (on a GPU node, the GPU memory the next replica there needs). The replica's
watchdog (`deployments/replica/engine_watchdog.py`) is what ends them then: this test starts a one-replica fleet
in a driver of its own, SIGKILLs every Ray process of it as `ray stop --force` does (the driver, GCS,
raylet, agents, workers), and checks that no engine process survives.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.support.fleet_helpers import free_port, process_tree

DRIVER = """
import os, sys, time
from core.config import load_config
from core.local_ray import start_ray
from deployments.fleet import deploy_fleet

tmp, model, port = sys.argv[1:]
cfg = load_config(None, ["fleet.num_replicas=1", f"fleet.port={port}", f"bucket.url=file://{tmp}/bucket",
                         f"bucket.cache_dir={tmp}/cache", "logging.run_name=engine-cleanup"])
start_ray(None)
deploy_fleet(cfg.own_fleet(), model, timeout_s=600)
print("READY", flush=True)
time.sleep(3600)
"""


def _engines(processes) -> list[psutil.Process]:
    return [p for p in processes if _cmdline(p).startswith("VLLM") or "VLLM::" in _cmdline(p)]


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return ""


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engines_die_with_their_replica_when_ray_is_killed_hard(tmp_path, tiny_model_path):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), tiny_model_path, str(free_port())],
        stdout=subprocess.PIPE,
        text=True,
    )
    engines: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while driver.stdout.readline().strip() != "READY":
            assert driver.poll() is None and time.monotonic() < deadline, "the fleet did not come up"
        tree = process_tree(driver.pid)
        engines = _engines(tree)
        assert engines, f"no vLLM engine process in the run: {[_cmdline(p)[:80] for p in tree]}"
        # What `ray stop --force` does: SIGKILL to every Ray process at once (no one is left to clean up).
        doomed = [p for p in tree if p not in engines and "engine_watchdog" not in _cmdline(p)]
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + 30
        while survivors := [p.pid for p in engines if _running(p)]:
            assert time.monotonic() < deadline, f"engine processes outlived their replica: {survivors}"
            time.sleep(0.5)
    finally:  # whatever happened, leave nothing behind (a failed run leaves orphaned engines)
        for proc in (process_tree(driver.pid) if driver.poll() is None else []) + engines:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        driver.kill()
        driver.wait()
