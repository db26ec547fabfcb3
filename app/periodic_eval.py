"""Evaluation during training: every `eval.every_steps` steps the version the learner committed last is evaluated
(by the driver's `measure`, `app.evaluate` through the fleet) on a thread of the driver, so that a step never waits
for it.

At most one evaluation is in flight. An evaluation that falls due meanwhile waits, and one more falling due before it
started replaces it (skipped, counted); whichever starts measures the version committed last when it starts, not the
one committed when it fell due: that one is served, while an older one may have left the fleet and the bucket
(`bucket.keep_versions`) already. An evaluation that fails (a replica lost under it, the fleet answering 5xx, every
episode lost) is tried again up to `eval.max_retries` times, each try on the newest version, then skipped, counted;
nothing it raises reaches the loop. The loop takes what landed after each step (`landed`) and logs it with that step's metrics, so
metrics.jsonl keeps one row per step and a tracker draws `eval/accuracy` as a curve (`eval/step` says which step's
version it measured).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    """What one evaluation of a version found: its held-out accuracy, the episodes lost, each extra set's accuracy,
    and each judge's agreement with the held-out measure (a judged run measured otherwise)."""

    accuracy: float
    lost: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    judge_agreement: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalPoint:
    """One point of the run's evaluation curve: the version committed at `step`, as measured."""

    step: int
    version: int
    measured: Measured
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        """As logged with a step's metrics (and read back by `from_metrics` when a run resumes)."""
        return {
            "eval/accuracy": self.measured.accuracy,
            "eval/version": self.version,
            "eval/step": self.step,
            "eval/lost": self.measured.lost,
            "eval/seconds": self.seconds,
            **{f"eval/{name}/accuracy": acc for name, acc in self.measured.extra.items()},
            **{f"eval/judge/{name}/agreement": share for name, share in self.measured.judge_agreement.items()},
        }

    @classmethod
    def from_metrics(cls, m: dict) -> EvalPoint | None:
        """The point a logged step's metrics carry, if any."""
        if "eval/version" not in m:
            return None
        extra = {
            k.removeprefix("eval/").removesuffix("/accuracy"): v
            for k, v in m.items()
            if k.startswith("eval/") and k.endswith("/accuracy") and k != "eval/accuracy"
        }
        agreed = {
            k.removeprefix("eval/judge/").removesuffix("/agreement"): v
            for k, v in m.items()
            if k.startswith("eval/judge/") and k.endswith("/agreement")
        }
        measured = Measured(m["eval/accuracy"], int(m.get("eval/lost", 0)), extra, agreed)
        return cls(int(m["eval/step"]), int(m["eval/version"]), measured, m.get("eval/seconds", 0.0))

    def row(self) -> dict:
        """As the summary's `eval_curve` lists it."""
        return {"step": self.step, "version": self.version, "accuracy": self.measured.accuracy, **self.measured.extra}


class PeriodicEvaluation:
    """Evaluates the newest committed version every `every_steps` steps on a daemon thread (see the module).

    `measure(version)` evaluates one version; `keep(version)`, when given, is called on the thread with each new best
    (e.g. to copy its adapter out of the bucket before the bucket's gc removes it); `best` is the best accuracy an
    earlier process of the run measured, which a kept version must beat."""

    def __init__(
        self,
        measure: Callable[[int], Measured],
        every_steps: int,
        max_retries: int,
        last_step: int,
        keep: Callable[[int], None] | None = None,
        best: float | None = None,
        retry_delay_s: float = 1.0,
    ):
        self.measure, self.every_steps, self.max_retries, self.last_step = measure, every_steps, max_retries, last_step
        self.keep, self.best, self.retry_delay_s = keep, best, retry_delay_s
        self.skipped = 0  # versions due that were never measured: replaced by a newer one, or failed every try
        self.retried = 0  # tries after a failure
        self._newest: tuple[int, int] = (0, 0)  # (step, version) committed last
        self._due = False  # an evaluation waits for the thread
        self._landed: list[EvalPoint] = []
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="periodic-eval", daemon=True)
        if every_steps > 0:
            self._thread.start()

    def committed(self, step: int, version: int) -> None:
        """The learner finished `step` with `version` committed: an evaluation is due every `every_steps` steps (not
        at the run's last step, which the driver's final evaluation measures). Returns at once."""
        if self.every_steps <= 0:
            return
        with self._cond:
            self._newest = (step, version)
            if step % self.every_steps or step >= self.last_step:
                return
            if self._due:
                self.skipped += 1  # one waits already: they measure one version, the newest when it starts
            self._due = True
            self._cond.notify_all()

    def landed(self) -> list[EvalPoint]:
        """The points measured since the last call, oldest first."""
        with self._cond:
            points, self._landed = self._landed, []
        return points

    def counts(self) -> dict[str, int]:
        """The skipped and retried evaluations so far, as logged (`eval/skipped`, `eval/retried`)."""
        with self._cond:
            return {"eval/skipped": self.skipped, "eval/retried": self.retried}

    def stop(self, wait_s: float = 0.0) -> list[EvalPoint]:
        """No more evaluations or retries; waits up to `wait_s` for one in flight (so that it does not compete with
        the driver's final one), and returns what landed since `landed` was last called. A version still waiting
        is skipped, counted."""
        with self._cond:
            self._stopping = True
            if self._due:
                self.skipped += 1
                self._due = False
            self._cond.notify_all()
        if self._thread.is_alive() and wait_s > 0:
            self._thread.join(wait_s)
        return self.landed()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                (step, version), self._due = self._newest, False
            point = self._evaluate(step, version)
            if point is None:
                continue
            log.info(
                "evaluation of version %d (step %d): held-out accuracy %.3f%s",
                version,
                step,
                point.measured.accuracy,
                "".join(f", {name} {acc:.3f}" for name, acc in point.measured.extra.items()),
            )
            if self.best is None or point.measured.accuracy > self.best:
                self.best = point.measured.accuracy
                self._keep(version)
            with self._cond:
                self._landed.append(point)

    def _evaluate(self, step: int, version: int) -> EvalPoint | None:
        """Measure `version`, and after a failure the newest version (an evaluation due meanwhile is this one);
        None when it was skipped (counted)."""
        for attempt in range(self.max_retries + 1):
            if attempt:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, self.retry_delay_s)
                    if self._stopping:
                        self.skipped += 1
                        return None
                    (step, version), self._due = self._newest, False
                    self.retried += 1
            t0 = time.perf_counter()
            try:
                measured = self.measure(version)
            except Exception as e:  # noqa: BLE001 - an evaluation never stops the run: retried, else skipped
                log.warning("evaluation of version %d (try %d) failed: %s", version, attempt + 1, _first_line(e))
                continue
            return EvalPoint(step, version, measured, time.perf_counter() - t0)
        with self._cond:
            self.skipped += 1
        log.warning("evaluation of version %d skipped after %d tries", version, self.max_retries + 1)
        return None

    def _keep(self, version: int) -> None:
        if self.keep is None:
            return
        try:
            self.keep(version)
        except Exception as e:  # noqa: BLE001 - the previous best stays kept; the summary names which one is
            log.warning("could not keep version %d as the best adapter: %s", version, _first_line(e))


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def eval_summary(points: list[EvalPoint], counts: dict[str, int], kept: int | None) -> dict:
    """The summary's part: the curve, its best version (the first of equals), what was skipped and retried, and the
    version kept as the run's final adapter (`eval.keep_best`), if any."""
    best = max(points, key=lambda p: p.measured.accuracy, default=None)  # max keeps the first of equals
    return {
        "eval_curve": [p.row() for p in points],
        "best_version": best and best.version,
        "best_step": best and best.step,
        "best_accuracy": best and best.measured.accuracy,
        "eval_skipped": counts["eval/skipped"],
        "eval_retried": counts["eval/retried"],
        "best_adapter_version": kept,
    }
