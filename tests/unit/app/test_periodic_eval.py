"""Evaluation during training (`app.periodic_eval`), with a fake `measure`: due every `every_steps` steps, never
making the caller wait, the newest version measured next (stale ones skipped, counted), a failure retried then
skipped (counted, never raised), stopped cleanly, the best kept; and its points in the run's record and summary."""

import threading
import time

import pytest

from app.periodic_eval import EvalPoint, Measured, PeriodicEvaluation, eval_summary
from app.run_log import Run
from core.config import load_config

from .test_run_log import rollout_stats, step


def wait_for(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def blocked_evaluator(timeout_s: float):
    """A `measure` that records each version it starts on and then blocks until `release` is set (or `timeout_s`)."""
    release, started = threading.Event(), []

    def measure(version: int) -> Measured:
        started.append(version)
        release.wait(timeout_s)
        return Measured(0.5)

    return measure, release, started


def collect(periodic: PeriodicEvaluation, n: int) -> list[EvalPoint]:
    points: list[EvalPoint] = []

    def enough() -> bool:
        points.extend(periodic.landed())
        return len(points) >= n

    wait_for(enough)
    return points


def test_due_every_n_steps_but_not_at_the_last_which_the_final_evaluation_measures():
    measured = []
    periodic = PeriodicEvaluation(lambda v: measured.append(v) or Measured(v / 10), 3, 0, last_step=9)
    for s in range(1, 10):
        periodic.committed(s, s + 100)
        wait_for(lambda s=s: len(measured) == s // 3 - (s == 9))
    points = collect(periodic, 2)
    assert [(p.step, p.version) for p in points] == [(3, 103), (6, 106)]
    assert measured == [103, 106] and periodic.counts() == {"eval/skipped": 0, "eval/retried": 0}
    periodic.stop(wait_s=1)


def test_off_with_every_steps_0():
    periodic = PeriodicEvaluation(lambda v: pytest.fail("measured"), 0, 0, last_step=9)
    for s in range(1, 10):
        periodic.committed(s, s)
    assert periodic.stop(wait_s=1) == [] and not periodic._thread.is_alive()


def test_a_blocked_evaluation_never_makes_a_step_wait_and_the_newest_version_is_measured_next():
    measure, release, started = blocked_evaluator(10)
    periodic = PeriodicEvaluation(measure, 1, 0, last_step=100)
    t0 = time.perf_counter()
    periodic.committed(1, 1)
    wait_for(lambda: started == [1])
    for s in range(2, 6):  # versions 2..5 fall due while 1 is measured: each replaces the one waiting
        periodic.committed(s, s)
    assert time.perf_counter() - t0 < 0.5  # the steps never waited on the evaluation blocked in flight
    release.set()
    points = collect(periodic, 2)
    assert started == [1, 5] and [p.version for p in points] == [1, 5]
    assert periodic.counts()["eval/skipped"] == 3  # versions 2, 3, 4: stale before they started
    periodic.stop(wait_s=1)


def test_a_failure_is_retried_then_measured_and_counted():
    tries = []

    def measure(version: int) -> Measured:
        tries.append(version)
        if len(tries) < 3:
            raise ConnectionError("replica lost")
        return Measured(0.7)

    periodic = PeriodicEvaluation(measure, 2, 2, last_step=100, retry_delay_s=0.01)
    periodic.committed(2, 7)
    (point,) = collect(periodic, 1)
    assert (point.version, point.measured.accuracy, tries) == (7, 0.7, [7, 7, 7])
    assert periodic.counts() == {"eval/skipped": 0, "eval/retried": 2}
    periodic.stop(wait_s=1)


def test_an_evaluation_failing_every_try_is_skipped_counted_and_the_next_one_still_runs():
    def measure(version: int) -> Measured:
        if version == 1:
            raise RuntimeError("every episode lost")
        return Measured(0.4)

    periodic = PeriodicEvaluation(measure, 1, 1, last_step=100, retry_delay_s=0.01)
    periodic.committed(1, 1)
    wait_for(lambda: periodic.counts()["eval/skipped"] == 1)
    assert periodic.counts()["eval/retried"] == 1
    periodic.committed(2, 2)
    assert [p.version for p in collect(periodic, 1)] == [2]
    periodic.stop(wait_s=1)


def test_a_retry_measures_the_newest_version_which_also_answers_an_evaluation_due_meanwhile():
    """A version that failed may be gone from the fleet and the bucket by the retry: the retry measures the newest."""
    fail_first = threading.Event()
    tries = []

    def measure(version: int) -> Measured:
        tries.append(version)
        if version == 1:
            fail_first.wait(5)
            raise ConnectionError("policy-v1 is not committed in the bucket")
        return Measured(0.3)

    periodic = PeriodicEvaluation(measure, 1, 5, last_step=100, retry_delay_s=0.01)
    periodic.committed(1, 1)
    wait_for(lambda: tries == [1])
    periodic.committed(2, 2)  # due while 1 is in flight
    periodic.committed(3, 3)  # replaces it: skipped, counted
    fail_first.set()
    (point,) = collect(periodic, 1)
    assert (point.step, point.version, tries) == (3, 3, [1, 3])
    assert periodic.counts() == {"eval/skipped": 1, "eval/retried": 1}
    periodic.stop(wait_s=1)
    assert periodic.landed() == []


def test_an_evaluation_starts_on_the_version_committed_last_not_the_one_when_it_fell_due():
    measure, release, started = blocked_evaluator(5)
    periodic = PeriodicEvaluation(measure, 2, 0, last_step=100)
    periodic.committed(2, 2)
    wait_for(lambda: started == [2])
    for s in range(3, 8):  # due at 4 (then replaced at 6: skipped), versions committed to 7
        periodic.committed(s, s)
    release.set()
    assert [(p.step, p.version) for p in collect(periodic, 2)] == [(2, 2), (7, 7)]
    assert periodic.counts()["eval/skipped"] == 1
    periodic.stop(wait_s=1)


def test_stop_waits_for_the_one_in_flight_retries_nothing_and_skips_the_one_waiting():
    release, tries = threading.Event(), []

    def measure(version: int) -> Measured:
        tries.append(version)
        release.wait(5)
        raise ConnectionError("the fleet is going away")

    periodic = PeriodicEvaluation(measure, 1, 3, last_step=100, retry_delay_s=0.01)
    periodic.committed(1, 1)
    wait_for(lambda: tries == [1])
    periodic.committed(2, 2)
    threading.Timer(0.1, release.set).start()
    assert periodic.stop(wait_s=5) == []
    assert not periodic._thread.is_alive() and tries == [1]
    assert periodic.counts() == {"eval/skipped": 2, "eval/retried": 0}


def test_each_new_best_is_kept_and_a_failing_keep_costs_nothing_else():
    accuracies = {1: 0.5, 2: 0.4, 3: 0.6, 4: 0.9}
    kept = []

    def keep(version: int) -> None:
        if version == 4:
            raise FileNotFoundError("gone from the bucket")
        kept.append(version)

    periodic = PeriodicEvaluation(lambda v: Measured(accuracies[v]), 1, 0, last_step=100, keep=keep, best=0.45)
    for v in accuracies:
        periodic.committed(v, v)
        wait_for(lambda v=v: v in [p.version for p in periodic._landed])
    assert kept == [1, 3] and len(periodic.landed()) == 4
    periodic.stop(wait_s=1)


def test_a_point_round_trips_through_the_logged_metrics_and_the_summary_names_the_first_best():
    point = EvalPoint(10, 9, Measured(0.75, 2, {"rg": 0.25}), 1.5)
    m = point.metrics()
    assert m["eval/accuracy"] == 0.75 and m["eval/rg/accuracy"] == 0.25 and m["eval/step"] == 10
    assert EvalPoint.from_metrics(m) == point and EvalPoint.from_metrics({"reward": 1.0}) is None
    curve = [EvalPoint(5, 5, Measured(0.5)), point, EvalPoint(15, 14, Measured(0.75))]
    summary = eval_summary(curve, {"eval/skipped": 1, "eval/retried": 2}, None)
    assert (summary["best_version"], summary["best_step"], summary["best_accuracy"]) == (9, 10, 0.75)
    assert summary["eval_curve"][1] == {"step": 10, "version": 9, "accuracy": 0.75, "rg": 0.25}
    assert (summary["eval_skipped"], summary["eval_retried"]) == (1, 2)


def test_the_run_logs_a_landed_point_with_its_step_and_a_resumed_run_reads_its_curve_back(tmp_path):
    cfg = load_config(None, [f"logging.output_dir={tmp_path}"])
    run = Run(cfg)
    plain = run.record(step(1, 0.0, False), rollout_stats(), 0.0)
    assert not any(k.startswith("eval/") for k in plain)
    point = EvalPoint(1, 1, Measured(0.6))
    logged = run.record(step(2, 0.0, False), rollout_stats(), 0.0, [point], {"eval/skipped": 0, "eval/retried": 1})
    assert logged["eval/version"] == 1 and logged["eval/retried"] == 1 and run.eval_points == [point]
    resumed = Run(cfg)
    resumed.restore([{**plain, "step": 1}, {**logged, "step": 2}])
    assert resumed.eval_points == [point]


def test_the_eval_section_checks_its_sets_and_an_extra_set_is_a_run_of_its_own_task():
    cfg = load_config(
        None,
        [
            "eval.every_steps=5",
            "eval.extra=[{name: digits3, task: {name: arithmetic, digits: 3, num_heldout: 8}}]",
        ],
    )
    (extra,) = cfg.eval.extra
    set_cfg = extra.applied_to(cfg)
    assert set_cfg.task.digits == 3 and set_cfg.eval.extra == [] and set_cfg.model == cfg.model
    with pytest.raises(Exception, match="distinct"):
        load_config(None, ["eval.extra=[{name: a, task: {name: arithmetic}}, {name: a, task: {name: arithmetic}}]"])
    with pytest.raises(Exception, match="reasoning_gym"):
        load_config(None, ["eval.extra=[{name: rg, task: {name: reasoning_gym}}]"])


def test_an_extra_sets_names_are_checked_at_start_as_a_runs_and_the_error_names_the_set():
    from app.tasks.checks import check_names
    from core.config import ConfigError

    cfg = load_config(None, ["eval.extra=[{name: odd, task: {name: arithmetic, reward_funcs: [nope]}}]"])
    with pytest.raises(ConfigError, match=r"eval.extra\[0\] \(odd\): task.reward_funcs\[0\]: unknown reward"):
        check_names(cfg)


def test_keep_best_copies_the_best_version_out_of_the_bucket_and_the_summary_names_it(tmp_path):
    """The driver's side (`app.run_evaluation.Evaluation`): each kept version replaces the folder kept before; at the
    end a final evaluation that is the best is kept too; a version the bucket lost leaves the one kept before."""
    from app.run_evaluation import Evaluation
    from core.bucket.store import AdapterStore

    cfg = load_config(
        None, [f"logging.output_dir={tmp_path}", f"bucket.url=file://{tmp_path}/bucket", "eval.keep_best=true"]
    )
    store = AdapterStore.from_config(cfg)
    for v in (1, 2, 3):
        folder = tmp_path / f"v{v}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 1}')
        (folder / "adapter_model.safetensors").write_bytes(f"weights {v}".encode())
        store.publish(folder, v)
    evaluation = Evaluation(cfg, "http://127.0.0.1:1", "unused", None)
    evaluation.keep(1)
    evaluation.keep(2)
    assert (evaluation.best_adapter / "adapter_model.safetensors").read_bytes() == b"weights 2"
    curve = [EvalPoint(2, 2, Measured(0.5)), EvalPoint(4, 3, Measured(0.8))]
    summary = evaluation.summary(curve, {"eval/skipped": 0, "eval/retried": 0})
    assert (summary["best_version"], summary["best_adapter_version"]) == (3, 3)
    assert (evaluation.best_adapter / "adapter_model.safetensors").read_bytes() == b"weights 3"
    curve.append(EvalPoint(6, 9, Measured(0.9)))  # never committed: gone from the bucket
    summary = evaluation.summary(curve, {"eval/skipped": 0, "eval/retried": 0})
    assert (summary["best_version"], summary["best_adapter_version"]) == (9, 3)
    assert summary["best_adapter"] == str(cfg.run_dir / "best_adapter")


def test_the_sets_of_an_evaluation_run_at_once_so_the_version_never_waits_unused_in_between(tmp_path):
    from app.run_evaluation import Evaluation

    cfg = load_config(None, [f"logging.output_dir={tmp_path}"])
    extra = {"a": cfg.model_copy(), "b": cfg.model_copy()}
    evaluation = Evaluation(cfg, "http://127.0.0.1:1", "unused", None, extra)
    together = threading.Barrier(3, timeout=5)  # the held-out split and both sets in flight at once, or it breaks
    accuracy = {id(cfg): 0.5, id(extra["a"]): 0.25, id(extra["b"]): 0.75}

    def of(version, set_cfg=None):
        together.wait()
        return {"accuracy": accuracy[id(set_cfg or cfg)], "lost": 1}

    evaluation.of = of
    assert evaluation.during(4) == Measured(0.5, 1, {"a": 0.25, "b": 0.75})
    evaluation.extra_sets = {}
    assert evaluation.during(4, {"accuracy": 0.9}) == Measured(0.9, 0, {})
