"""The vLLM engine processes of a replica die with it: a watchdog process per replica.

vLLM runs each engine core (and its workers) in child processes of the replica. When the replica's
Ray worker dies hard (an actor crash, SIGKILL, `ray stop --force`, a preempted node's agent), nothing
tells those children: they are re-parented to init and keep running, holding their memory and, on a
GPU node, the GPU memory that the replica Ray starts next on that node needs. The replica therefore
starts this watchdog once its engine is up; it polls the replica and, once the replica is gone,
terminates the engine processes it was given (SIGTERM, then SIGKILL after a grace period).

    python -m deployments.replica.engine_watchdog PARENT_PID PARENT_START PID [PID ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 1.0
GRACE_S = 5.0


def started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (`/proc/PID/stat`'s starttime), or None if there is no
    such process. Not psutil's `create_time`: that adds the boot time as the clock says it now, and a clock step (NTP,
    a VM resumed from a snapshot) moves it, which made every watchdog of a machine take its live replica for gone
    and end its engine (both replicas' engines at once, a run's fleet restarting under it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[19])  # field 22 of proc(5), the 20th after the name


def _alive(pid: int, start: int) -> bool:
    """The process `pid` that started at `start` (`started`) still runs (a reused pid is another process)."""
    return started(pid) == start


def terminate(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the processes, SIGKILL those still alive after `grace_s`; returns the pids that were running."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def watch(parent_pid: int, parent_start: int, pids: list[int], poll_s: float = POLL_S) -> list[int]:
    """Wait for the parent (`parent_pid`, started at `parent_start`: `started`) to go, then end `pids`."""
    while _alive(parent_pid, parent_start):
        time.sleep(poll_s)
    return terminate(pids)


def start_watchdog(engine_pids: list[int]) -> subprocess.Popen | None:
    """Watch this process on behalf of `engine_pids` (its engine processes); None when there are none.

    The watchdog runs in a session of its own, so that a signal to the replica's process group does not
    take the watchdog with it before it has done its work."""
    if not engine_pids:
        return None
    me = os.getpid()
    cmd = [sys.executable, "-m", "deployments.replica.engine_watchdog", str(me), str(started(me))]
    cmd += [str(pid) for pid in engine_pids]
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, cwd=os.getcwd())


def engine_processes() -> list[int]:
    """The pids of this process's descendants: the engine cores and workers vLLM started."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


if __name__ == "__main__":
    parent, start, *watched = sys.argv[1:]
    watch(int(parent), int(start), [int(p) for p in watched])
