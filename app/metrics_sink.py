"""Where a run's metrics go each step: runs/<name>/metrics.jsonl, trackio (offline) and Ray metrics.

One writer, so the file, the trackio project and the Ray dashboard always show the same numbers.
Ray gauges carry the metric name with `/` replaced (Prometheus names allow `[a-zA-Z0-9_:]` only).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)


def prometheus_name(name: str) -> str:
    return "spotrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class MetricsSink:
    def __init__(self, run_dir: Path, run_name: str, config: dict, use_trackio: bool = True, use_ray: bool = True):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics.jsonl").open("a")
        self._gauges: dict = {}
        self._use_ray = use_ray
        self._trackio = None
        if use_trackio:
            try:
                os.environ.setdefault("TRACKIO_DIR", str(run_dir.parent / "trackio"))
                import trackio

                trackio.init(project="spotrl", name=run_name, config=config, resume="allow")
                self._trackio = trackio
            except Exception as e:  # tracking is a convenience: never let it stop a run
                log.warning("trackio disabled: %s", e)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **metrics}  # wall clock: stalls show as gaps
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._trackio is not None:
            try:
                self._trackio.log(numeric, step=step)
            except Exception as e:
                log.warning("trackio log failed: %s", e)
        if self._use_ray:
            self._log_ray(numeric)

    def _log_ray(self, numeric: dict[str, float]) -> None:
        from ray.util.metrics import Gauge

        for name, value in numeric.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(prometheus_name(name), description=name)
            gauge.set(value)

    def close(self) -> None:
        self._file.close()
        if self._trackio is not None:
            try:
                self._trackio.finish()
            except Exception as e:
                log.warning("trackio finish failed: %s", e)
