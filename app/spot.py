"""A run's answer to spot notices (`contracts.notices`), and what it tells a user who runs it again.

On the embedded default everything runs on the driver's machine, so a notice for that machine (its cloud's
metadata, a scheduler's file, a SIGTERM to the driver) means: finish the step under way, checkpoint, stop
cleanly with exit code 0 and one line that says the same command resumes. In a cluster the learner's node
has its own watcher (`app.learner`), and the replicas' nodes theirs (`deployments`).

Run again, a run says in one line where it resumes (step and version), and a run that already reached
`train.max_steps` is reported in one line and left untouched.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

from contracts.notice_sources import watched_sources
from contracts.notice_watcher import NoticeWatcher
from contracts.notices import Notice

log = logging.getLogger("spotrl.spot")


class Preempted(Exception):
    """The driver's machine got a notice: the run stopped after checkpointing; the same command resumes it."""


class DriverNotices:
    """The notices of the driver's own machine. A first SIGTERM is a notice (`spot.sigterm_grace_s`); a second one,
    or one while notices are not watched (`spot.watch` false), stops the run at once, as Ctrl-C does. `joined`: the
    driver joined a cluster (`--address`), where `spot.metadata: auto` watches the clouds' metadata services."""

    def __init__(self, spot, joined: bool = False):
        self.spot = spot
        self.watcher = (
            NoticeWatcher(
                [],
                interval_s=spot.poll_interval_s,
                notice_file=spot.notice_file,
                sources=watched_sources(spot, joined),
            )
            if spot.watch
            else None
        )
        self.take_sigterm()

    def take_sigterm(self) -> None:
        """Be this process's SIGTERM handler (again: `ray.init` installs one of its own, which exits at once)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def start(self) -> DriverNotices:
        if self.watcher is not None:
            self.watcher.start()
        return self

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    @property
    def binding(self) -> Notice | None:
        return self.watcher.binding if self.watcher is not None else None

    def _on_sigterm(self, signum, frame) -> None:
        if self.watcher is None or self.binding is not None:
            raise KeyboardInterrupt
        self.watcher.report(Notice("sigterm", time.time() + self.spot.sigterm_grace_s, "SIGTERM to the driver"))


def preempted_line(cfg, notice: Notice, step: int, version: int) -> str:
    return (
        f"run {cfg.logging.run_name} was preempted ({notice.describe()}): checkpointed at step {step} "
        f"(policy-v{version}) in {cfg.bucket_url}; the same command resumes it"
    )


def resumed_line(cfg, step: int, version: int) -> str:
    return (
        f"resuming run {cfg.logging.run_name} from step {step} (policy-v{version}), "
        f"{cfg.train.max_steps - step} of {cfg.train.max_steps} steps to go"
    )


def finished_line(cfg) -> str | None:
    """One line about this run if its learner already reached `train.max_steps` (a checkpoint in its bucket at or
    past it), else None. Reads the bucket's listing and the run's summary.json; writes nothing."""
    from core.bucket.store import CheckpointStore

    step = CheckpointStore.from_config(cfg).latest()
    if step is None or step < cfg.train.max_steps:
        return None
    summary_file = cfg.run_dir / "summary.json"
    try:
        summary = json.loads(summary_file.read_text())
    except (OSError, ValueError):
        summary = {}
    before, after = summary.get("heldout_accuracy_before"), summary.get("heldout_accuracy_after")
    accuracy = (
        f"held-out accuracy {before:.1%} -> {after:.1%}"
        if isinstance(before, float) and isinstance(after, float)
        else "held-out accuracy not recorded (no summary.json)"
    )
    return (
        f"run {cfg.logging.run_name} is finished ({step} steps, train.max_steps={cfg.train.max_steps}; {accuracy}): "
        f"its files are in {cfg.run_dir}/ and {cfg.bucket_url}. Train it further with "
        f'ARGS="--set train.max_steps={2 * cfg.train.max_steps}", or start a new run with '
        f'ARGS="--set logging.run_name=<new name>"'
    )
