"""What a run records: verdicts printed when they change, the summary's share of samples continued across versions,
and a resumed run's summary that is the whole run's."""

from contextlib import ExitStack

from app.messages import RolloutStats, StepResult
from app.run_log import Run, StepLog, previous_steps
from contracts.rollouts import VERSIONS, BatchStats, Group, Sample
from core.config import load_config


def rollout_stats(**figures) -> RolloutStats:
    base = dict.fromkeys(
        [
            "queue_size_at_take",
            "queue_size_now",
            "inflight",
            "generated_tok_s",
            "dropped_stale_total",
            "dropped_stale_share",
            "dropped_failed_total",
            "request_retries_total",
            "groups_produced_total",
            "data_cursor",
            "data_frontier",
            "idle_s",
        ],
        0,
    )
    return RolloutStats(**{**base, **figures})


def step(number: int, clip: float, partial: bool, lag: int = 0) -> StepResult:
    versions = [float(number - 1), float(number)] if partial else [float(number)] * 2
    samples = [Sample([5, 6], [-1.0, -1.0], 1.0, streams={VERSIONS: versions}), Sample([5], [-1.0], 0.0)]
    batch = BatchStats.of([Group(number, "p", [1], number, samples)], learner_version=number + lag)
    metrics = {"perf/step_s": 1.0, "clip_ratio/region_mean": clip, "loss": 0.0}
    return StepResult(number, number, [number], metrics, batch)


def test_verdicts_are_printed_when_they_change_and_the_summary_counts_partial_samples(tmp_path, capsys):
    cfg = load_config(
        None,
        [
            f"logging.output_dir={tmp_path}",
            "logging.report_to=[jsonl, ray]",
            "logging.diagnose_every=2",
            "rollout.queue_maxsize=16",
        ],
    )
    cfg.run_dir.mkdir(parents=True)
    run = Run(cfg)
    printed = []
    with ExitStack() as stack:
        log = StepLog(stack, run, 0)
        log.bar.write = printed.append
        clips = [0.01, 0.01, 0.01, 0.01, 0.4, 0.4, 0.4, 0.4]  # healthy, then tokens pile up at the clip bounds
        for number, clip in enumerate(clips, start=1):
            result = step(number, clip, partial=number % 2 == 0)
            log.write(result, run.record(result, rollout_stats(queue_size_at_take=16), 0.0))
    assert [line.split(" (")[0] for line in printed] == ["bottleneck: trainer-bound", "drift alarm: drifting"]
    summary = run.summary(None, None, rollout_stats(cut_share=0.25, prefilled_again_total=40), None)
    assert summary["partial_share"] == 4 / 16 and summary["cut_share"] == 0.25
    assert summary["prefilled_again_total"] == 40


def _config(tmp_path, name: str):
    cfg = load_config(
        None, [f"logging.output_dir={tmp_path}", "logging.report_to=[jsonl, ray]", f"logging.run_name={name}"]
    )
    cfg.run_dir.mkdir(parents=True)
    return cfg


def _train(run: Run, log: StepLog, numbers) -> None:
    for number in numbers:
        result = step(number, 0.01, partial=number % 2 == 0, lag=number % 3)
        log.write(result, run.record(result, rollout_stats(), 0.0))


def test_a_resumed_runs_summary_counts_the_steps_its_earlier_process_trained(tmp_path):
    """Steps 1-5 trained, checkpointed at 4, the process lost; step 5 trained again by the resumed one, then 6-8:
    the summary is the one an unbroken run of 8 steps writes (step 5's second line is the one that counts)."""
    whole = Run(_config(tmp_path, "whole"))
    with ExitStack() as stack:
        _train(whole, StepLog(stack, whole, 0), range(1, 9))

    cfg = _config(tmp_path, "resumed")
    with ExitStack() as stack:
        first = Run(cfg)
        _train(first, StepLog(stack, first, 0), range(1, 6))
    (cfg.run_dir / "metrics.jsonl").open("a").write('{"step": 6, "samp')  # a line cut short as the process died
    resumed = Run(cfg)
    restored = previous_steps(cfg.run_dir, 4)
    assert [m["step"] for m in restored] == [1, 2, 3, 4]
    resumed.restore(restored)
    with ExitStack() as stack:
        _train(resumed, StepLog(stack, resumed, 4), range(5, 9))

    keys = ["steps", "samples_trained", "staleness_mean", "staleness_max", "partial_share", "reward_last_10pct"]
    expected = whole.summary(None, None, rollout_stats(), None)
    got = resumed.summary(None, None, rollout_stats(), None)
    assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}
    assert got["steps"] == 8 and got["samples_trained"] == 16 and got["staleness_max"] == 3
    assert previous_steps(cfg.run_dir, 0) == [] and previous_steps(tmp_path / "none", 3) == []


def test_the_summary_counts_the_samples_each_reward_function_failed_on(tmp_path):
    """A run whose reward raised on every sample ended with reward 0 and no word of it in `summary.json`."""
    run = Run(_config(tmp_path, "rewards"))
    failing = {"reward/errors/counted_right": 640.0, "reward/errors/exact_answer": 0.0, "reward/errors_total": 640.0}
    summary = run.summary(None, None, rollout_stats(reward_metrics=failing), None)
    assert summary["reward_errors"] == {"counted_right": 640, "exact_answer": 0}
    assert summary["reward_errors_total"] == 640
