"""Where a run's metrics go each step: runs/<name>/metrics.jsonl and the trackers `logging.report_to` names.

One writer feeds all, so that the file, trackio, the Ray dashboard, TensorBoard and wandb always show the same
numbers. metrics.jsonl is the run's own record (a resumed run reads its steps back); a tracker is a convenience, so
one that fails to start or to log is named in a warning and never stops the run. wandb runs offline unless
WANDB_MODE says otherwise (nothing leaves the machine by default; `wandb sync` uploads a run afterwards).
Ray gauges carry the metric name with `/` replaced (Prometheus names allow `[a-zA-Z0-9_:]` only).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


def prometheus_name(name: str) -> str:
    return "spotrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class Tracker(Protocol):
    """A place a step's numbers also go."""

    def log(self, numeric: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class Trackio:
    """The trackio project `spotrl` (offline, SQLite under TRACKIO_DIR, by default beside the runs)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict):
        os.environ.setdefault("TRACKIO_DIR", str(run_dir.parent / "trackio"))
        import trackio

        trackio.init(project="spotrl", name=run_name, config=config, resume="allow")
        self._trackio = trackio

    def log(self, numeric: dict[str, float], step: int) -> None:
        self._trackio.log(numeric, step=step)

    def close(self) -> None:
        self._trackio.finish()


class RayGauges:
    """One Ray gauge per metric, which the dashboard (and Prometheus) shows as `spotrl_*`."""

    def __init__(self, run_dir: Path, run_name: str, config: dict):
        self._gauges: dict = {}

    def log(self, numeric: dict[str, float], step: int) -> None:
        from ray.util.metrics import Gauge

        for name, value in numeric.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(prometheus_name(name), description=name)
            gauge.set(value)

    def close(self) -> None:
        pass


class TensorBoard:
    """Event files under runs/<name>/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, numeric: dict[str, float], step: int) -> None:
        for name, value in numeric.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Wandb:
    """A wandb run of project `spotrl`, offline under runs/<name>/wandb (or WANDB_DIR) unless WANDB_MODE says online.

    Its x axis is the run's `step` metric, not wandb's own counter: a learner resumed from its checkpoint logs step
    numbers again, which wandb's counter would drop."""

    def __init__(self, run_dir: Path, run_name: str, config: dict):
        import wandb

        self._run = wandb.init(
            project="spotrl",
            name=run_name,
            config=config,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            mode=os.environ.get("WANDB_MODE") or "offline",
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, numeric: dict[str, float], step: int) -> None:
        self._run.log({"step": step, **numeric})

    def close(self) -> None:
        self._run.finish()


TRACKERS: dict[str, Callable[[Path, str, dict], Tracker]] = {
    "trackio": Trackio,
    "ray": RayGauges,
    "tensorboard": TensorBoard,
    "wandb": Wandb,
}


class MetricsSink:
    """metrics.jsonl, then every tracker of `report_to` (`logging.report_to`) with the step's numeric metrics."""

    def __init__(self, run_dir: Path, run_name: str, config: dict, report_to: list[str]):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics.jsonl").open("a")
        self.trackers: dict[str, Tracker] = {}
        for name in report_to:
            if name == "jsonl":
                continue
            try:
                self.trackers[name] = TRACKERS[name](run_dir, run_name, config)
            except Exception as e:  # tracking is a convenience: never let it stop a run
                log.warning("%s disabled: %s", name, e)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}  # wall clock: stalls show as gaps
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self._each("log", lambda tracker: tracker.log(numeric, step))

    def close(self) -> None:
        self._file.close()
        self._each("finish", lambda tracker: tracker.close())

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in self.trackers.items():
            try:
                call(tracker)
            except Exception as e:
                log.warning("%s %s failed: %s", name, what, e)
