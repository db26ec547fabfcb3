"""The embedded default's metrics where people look: a run with `logging.report_to=[jsonl, tensorboard, wandb]`
writes metrics.jsonl, TensorBoard's event files and an offline wandb run, each with every step, and wandb reaches no
server (its server, were it asked, is a socket of this test's that counts who connects)."""

import socket

import pytest

from tests.integration.test_train import run_train


@pytest.mark.slow  # ~1.5 min; in CI test_metrics_sink writes each tracker's files from the same rows
def test_a_run_reports_every_step_to_jsonl_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    steps = 2
    try:
        _, metrics, _ = run_train(tmp_path, steps, "logging.report_to=[jsonl, tensorboard, wandb]")
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()

    assert [m["step"] for m in metrics] == [1, 2]
    events = EventAccumulator(str(tmp_path / "smoke" / "tensorboard"))
    events.Reload()
    written = [(e.step, e.value) for e in events.Scalars("reward")]  # float32 in the event files
    assert written == [(m["step"], pytest.approx(m["reward"], abs=1e-6)) for m in metrics]
    assert "perf/step_s" in events.Tags()["scalars"]
    runs = list((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert not (tmp_path / "trackio").exists()  # trackio is not among the trackers named
