"""The learner's answer to a spot notice for its node: lose no step, train no group twice.

Rank 0 watches its node (`contracts.notices`: the cloud's metadata, a scheduler's file or SIGTERM, Ray draining
the node) and, on an interruption notice, drains the node in Ray (`spot.drain_node`). From then on the rank:
- finishes the step under way when the deadline allows it (what the last step took, plus the last checkpoint,
  plus `spot.deadline_margin_s`), else abandons it: its gradient is dropped and none of its groups is marked
  trained, so that the learner group trains the same batch again on the node's replacement (`app.learner.group`);
- checkpoints at once (an idle single-rank learner from the watcher's thread; otherwise at the end of the step
  under way, or before the next one), and again after every step until the node goes, so that the replacement
  resumes exactly where this one stopped;
- says in the log when the notice is shorter than a checkpoint takes: the steps since the last checkpoint will
  then be trained again. Notice-to-checkpoint-committed seconds go into the step's metrics (`spot/*`).

The ranks share one node (STRICT_PACK), so rank 0's watcher speaks for all of them: what it decides reaches the
others through the step's collectives (`LearnerRank`). A learner on the head node (the embedded default, where
everything shares one machine) leaves its notices to the driver, which checkpoints after the step under way and
stops (`app.spot`). A first SIGTERM to any rank is a notice, not an exit;
the second one, or the grace period's SIGKILL, ends the process.

Nothing here imports Ray or the notice sources at import time (`bench.learner_gpu` drives a rank without either).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from contracts.notices import OUTLIVED_S

if TYPE_CHECKING:
    from contracts.notices import Notice

log = logging.getLogger(__name__)


class StepAbandoned(Exception):
    """The node's deadline leaves no time to finish the step under way."""


class LearnerNotices:
    """What one rank knows of a notice for its node, and the timings that decide whether a step still fits."""

    def __init__(self, spot=None):
        self.spot = spot  # `core.config.SpotConfig`; None where no config has one (a benchmark's stand-in)
        self.notice: Notice | None = None
        self.heard_at: float | None = None  # unix seconds when the notice reached this rank
        self.step_s: float | None = None  # what the last step took
        self.checkpoint_s: float | None = None  # what the last checkpoint took
        self._reported = False  # notice-to-checkpoint was measured already
        self._metrics: dict[str, float] = {}
        self._watcher = None
        self._on_notice: Callable[[], None] | None = None

    def watch(self, rank: int, on_notice: Callable[[], None] | None = None) -> LearnerNotices:
        """Watch this rank's node (rank 0), or take a first SIGTERM as a notice rank 0 acts on (the others).
        `on_notice` runs in the watcher's thread once a notice has been handled (the rank checkpoints an idle
        learner there)."""
        from contracts.notices import on_head_node

        spot = self.spot
        if spot is None or not spot.watch or on_head_node():  # the head's notices are the driver's (`app.spot`)
            return self
        self._on_notice = on_notice
        self._watcher = node_watcher(spot, [self._heard], sources=rank == 0)
        if rank == 0:
            self._watcher.start()
        return self

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def _heard(self, notice: Notice) -> None:
        if not notice.binding:  # AWS's rebalance recommendation: the interruption may follow, or not
            log.warning("spot: %s; the learner checkpoints when the interruption itself comes", notice.describe())
            return
        self.heard(notice)
        drain_if_asked(self.spot, notice)
        if self._on_notice is not None:
            self._on_notice()

    def heard(self, notice: Notice, now: float | None = None) -> None:
        """A binding notice for this rank's node: from now on every step is checkpointed, and may be abandoned."""
        self.notice, self.heard_at = notice, time.time() if now is None else now
        left = notice.remaining_s(self.heard_at)
        if left is not None and self.checkpoint_s is not None and left < self.checkpoint_s:
            log.warning(
                "spot: %s, but a checkpoint takes %.1f s: the node may go before it is committed, and the steps "
                "since the last checkpoint would then be trained again on the replacement",
                notice.describe(),
                self.checkpoint_s,
            )
        else:
            took = f"a checkpoint takes {self.checkpoint_s:.1f} s" if self.checkpoint_s else "no checkpoint timed yet"
            log.warning("spot: %s; the learner checkpoints at once and after every step (%s)", notice.describe(), took)

    @property
    def noticed(self) -> bool:
        return self.notice is not None

    def step_fits(self, elapsed_s: float = 0.0, now: float | None = None) -> bool:
        """Whether a step `elapsed_s` under way (0: about to start) can end, checkpointed, before the node goes."""
        left = self.notice.remaining_s(now) if self.notice is not None else None
        if left is None or left < -OUTLIVED_S:
            return True
        margin = self.spot.deadline_margin_s if self.spot is not None else 0.0
        needed = max(0.0, (self.step_s or 0.0) - elapsed_s) + (self.checkpoint_s or 0.0) + margin
        return left >= needed

    def deadline(self) -> float | None:
        return self.notice.deadline if self.notice is not None else None

    def checkpointed(self, seconds: float, now: float | None = None) -> None:
        """A checkpoint was committed in `seconds` (the first after a notice: notice-to-committed is measured)."""
        self.checkpoint_s = seconds
        self._metrics["perf/checkpoint_s"] = seconds
        if self.notice is not None and not self._reported:
            self._reported = True
            took = (time.time() if now is None else now) - self.heard_at
            self._metrics["spot/notice_to_checkpoint_s"] = took
            log.warning("spot: checkpoint committed %.1f s after the notice", took)

    def take_metrics(self) -> dict[str, float]:
        """The checkpoint metrics since the last step's result (a checkpoint made between steps included)."""
        metrics, self._metrics = self._metrics, {}
        if self.notice is not None:
            metrics["spot/noticed"] = 1.0
        return metrics


def node_watcher(spot, handlers: list[Callable[[Notice], None]], sources: bool = True):
    """A learner process's `NoticeWatcher` (not started) for its node (`core.config.SpotConfig`): with `sources`, the
    clouds' metadata, the scheduler's file and Ray's drain, reported to `handlers`; either way a first SIGTERM is a
    notice and not the end of the process (the learner must checkpoint first), the second one is."""
    from contracts.notice_sources import RayDrain, watched_sources
    from contracts.notice_watcher import NoticeWatcher
    from contracts.notices import on_head_node

    return NoticeWatcher(
        handlers if sources else [],
        interval_s=spot.poll_interval_s,
        probe_timeout_s=spot.probe_timeout_s,
        notice_file=spot.notice_file if sources else None,
        # A node of a cluster that is not its head is one that joined it (`spot.metadata`).
        sources=[*watched_sources(spot, joined=not on_head_node()), RayDrain(spot.sigterm_grace_s)] if sources else [],
        sigterm_grace_s=spot.sigterm_grace_s,
        chain_sigterm=False,
    )


def drain_if_asked(spot, notice: Notice) -> None:
    """Drain the noticed node in Ray (`spot.drain_node`), so that nothing new, the learner's replacement included, is
    scheduled on it; not for a notice that comes from Ray's drain or a SIGTERM (`Notice.drains_node`)."""
    if spot.drain_node and notice.drains_node:
        from contracts.notices import drain_this_node

        drain_this_node(notice)
