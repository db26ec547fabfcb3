"""One writer feeds every tracker (`app.metrics_sink.MetricsSink`): each step's numbers land in metrics.jsonl, in
TensorBoard's event files and in an offline wandb run alike; a tracker that fails never costs the others a step, and
wandb offline reaches no server."""

import json
import logging
import socket

import pytest

from app import metrics_sink
from app.metrics_sink import MetricsSink

STEPS = [({"reward": 0.25, "perf/step_s": 1.5, "verdict": "warming-up"}, 1), ({"reward": 0.5, "perf/step_s": 1.0}, 2)]


class Recording:
    """A tracker that keeps what it was given."""

    def __init__(self, run_dir, run_name, config):
        self.logged, self.closed = [], False

    def log(self, numeric, step):
        self.logged.append((step, numeric))

    def close(self):
        self.closed = True


class FailsToLog(Recording):
    def log(self, numeric, step):
        raise OSError("disk full")


def FailsToStart(run_dir, run_name, config):  # noqa: N802 - stands where a tracker's class does
    raise RuntimeError("no such project")


@pytest.fixture
def trackers(monkeypatch):
    registry = {**metrics_sink.TRACKERS, "a": Recording, "b": FailsToLog, "c": FailsToStart, "d": Recording}
    monkeypatch.setattr(metrics_sink, "TRACKERS", registry)


def _write(sink: MetricsSink) -> None:
    for metrics, step in STEPS:
        sink.log(metrics, step)
    sink.close()


def _jsonl(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_tracker_gets_every_steps_numbers_and_one_that_fails_costs_the_others_nothing(tmp_path, trackers, caplog):
    caplog.set_level(logging.WARNING, logger="app.metrics_sink")
    sink = MetricsSink(tmp_path / "run", "run", {}, ["jsonl", "a", "b", "c", "d"])
    a, d = sink.trackers["a"], sink.trackers["d"]
    _write(sink)
    numeric = [(1, {"reward": 0.25, "perf/step_s": 1.5}), (2, {"reward": 0.5, "perf/step_s": 1.0})]
    assert a.logged == numeric and d.logged == numeric and a.closed and d.closed
    assert [{k: v for k, v in m.items() if k != "time"} for m in _jsonl(tmp_path / "run")] == [
        {"step": step, **metrics} for metrics, step in STEPS
    ]
    assert set(sink.trackers) == {"a", "b", "d"}
    warnings = [r.getMessage() for r in caplog.records]
    assert "c disabled: no such project" in warnings
    assert warnings.count("b log failed: disk full") == 2


def test_jsonl_alone_feeds_no_tracker(tmp_path):
    sink = MetricsSink(tmp_path / "run", "run", {}, ["jsonl"])
    _write(sink)
    assert sink.trackers == {} and len(_jsonl(tmp_path / "run")) == 2


def test_tensorboard_holds_each_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(MetricsSink(tmp_path / "run", "run", {}, ["jsonl", "tensorboard"]))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward", "perf/step_s"}
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]


def test_wandb_writes_an_offline_run_and_reaches_no_server(tmp_path, monkeypatch):
    """Its server, were it asked, is a socket of this test's that counts who connects."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the writer's default
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        _write(MetricsSink(tmp_path / "run", "run", {"lora": {"rank": 4}}, ["jsonl", "wandb"]))
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
