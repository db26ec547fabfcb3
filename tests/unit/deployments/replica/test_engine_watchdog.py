"""deployments.replica.engine_watchdog: processes a dead parent leaves behind are ended, live parents are left alone."""

import subprocess
import sys
import time

import psutil

from deployments.replica.engine_watchdog import _alive, started, terminate, watch

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"]


def test_a_parent_that_dies_takes_the_watched_processes_with_it():
    # The "replica": a process that starts an "engine" and the real watchdog, then dies by SIGKILL.
    script = f"""
import subprocess, sys, time
from deployments.replica.engine_watchdog import start_watchdog
engine = subprocess.Popen({SLEEPER!r}, start_new_session=True)
start_watchdog([engine.pid])
print(engine.pid, flush=True)
time.sleep(120)
"""
    replica = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine_pid = int(replica.stdout.readline())
    assert psutil.pid_exists(engine_pid)
    time.sleep(1.5)
    assert psutil.Process(engine_pid).status() != psutil.STATUS_ZOMBIE  # alive while the replica is
    replica.kill()
    replica.wait()
    deadline = time.monotonic() + 20
    while psutil.pid_exists(engine_pid) and psutil.Process(engine_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphaned engine survived its replica"
        time.sleep(0.2)


def test_terminate_kills_what_ignores_sigterm_and_skips_what_is_gone():
    stubborn = subprocess.Popen(STUBBORN)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    time.sleep(0.5)  # let the stubborn one install its handler
    assert terminate([stubborn.pid, gone.pid], grace_s=1.0) == [stubborn.pid]
    assert stubborn.wait(timeout=10) != 0


def test_watch_returns_at_once_for_a_parent_that_is_already_gone():
    sleeper = subprocess.Popen(SLEEPER)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = started(dead.pid)
    dead.wait()
    assert watch(dead.pid, start, [sleeper.pid], poll_s=0.1) == [sleeper.pid]
    sleeper.wait(timeout=10)


def test_a_live_parent_is_known_by_its_start_since_boot_whatever_the_clock_says(monkeypatch):
    """A clock step (NTP, a VM resumed from a snapshot) moves the boot time psutil adds to a process's start: a
    watchdog comparing those took its live replica for gone and ended its engine. The start since boot stays."""
    parent = subprocess.Popen(SLEEPER)
    try:
        start = started(parent.pid)
        assert start == started(parent.pid) and _alive(parent.pid, start) and not _alive(parent.pid, start + 1)
        stepped = psutil.boot_time() + 1.0  # the clock stepped a second since the parent started
        created_before = psutil.Process(parent.pid).create_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
        assert psutil.Process(parent.pid).create_time() != created_before  # what the watchdog used to compare
        assert _alive(parent.pid, start)
    finally:
        parent.kill()
        parent.wait()
    assert started(parent.pid) is None and not _alive(parent.pid, start)
