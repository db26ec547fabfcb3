"""bench/dynamic_sampling.py's pure parts: generated samples from the metrics, the matching at equal samples and equal
wall time, the plain arm's length, the comparison and the verdict."""

from __future__ import annotations

import pytest

from bench import dynamic_sampling as ds


def row(step: int, produced: int, dropped: int, time: float, **extra) -> dict:
    return {
        "step": step,
        "time": time,
        "rollout/groups_produced_total": produced,
        "rollout/dropped_zero_variance_total": dropped,
        **extra,
    }


def test_generated_samples_count_the_groups_dynamic_sampling_dropped():
    assert ds.generated_samples(row(1, 32, 0, 0.0), 8) == 256
    assert ds.generated_samples(row(1, 32, 10, 0.0), 8) == 336
    # a run from before the counter: nothing dropped
    assert ds.generated_samples({"rollout/groups_produced_total": 3}, 8) == 24


def test_step_curve_reads_wall_from_the_loop_end_and_skips_rows_without_rollout_counters():
    metrics = [
        row(2, 48, 4, 102.0),
        row(1, 32, 2, 101.0),
        {"step": 2, "time": 103.0, "eval/accuracy": 0.5},  # an evaluation's row: no rollout counters
        row(3, 64, 9, 105.0),
    ]
    curve = ds.step_curve(metrics, loop_wall_s=10.0, group_size=8)
    assert curve == [
        ds.StepPoint(1, 272, 6.0),
        ds.StepPoint(2, 416, 7.0),
        ds.StepPoint(3, 584, 10.0),
    ]


def test_nearest_takes_the_closest_step_and_the_earlier_of_a_tie():
    curve = [ds.StepPoint(s, 128 * s, 2.0 * s) for s in range(1, 6)]
    assert ds.nearest(curve, "generated", 300).step == 2  # 256 is 44 away, 384 is 84
    assert ds.nearest(curve, "generated", 320).step == 2  # a tie: the earlier
    assert ds.nearest(curve, "wall_s", 7.1).step == 4
    assert ds.nearest(curve, "generated", 10_000).step == 5  # past the end: the last step


def test_plain_runs_long_enough_to_generate_what_dynamic_generated():
    dynamic = [ds.StepPoint(40, 8000, 60.0)]
    steps = ds.plain_steps_for(dynamic, groups_per_step=16, group_size=8)
    assert steps * 128 >= 8000 and steps == 69  # 8000 / 128 = 62.5, with a tenth to spare


def test_match_steps_and_the_plain_steps_to_evaluate():
    dynamic = [ds.StepPoint(s, 200 * s, 3.0 * s) for s in range(1, 5)]
    plain = [ds.StepPoint(s, 128 * s, 2.0 * s) for s in range(1, 8)]
    matches = ds.match_steps(dynamic, plain, [2, 4])
    assert [m.dynamic.step for m in matches] == [2, 4]
    assert [m.equal_samples.step for m in matches] == [3, 6]  # 400 -> 384, 800 -> 768
    assert [m.equal_wall.step for m in matches] == [3, 6]  # 6 s, 12 s
    assert [m.equal_steps.step for m in matches] == [2, 4]
    assert ds.plain_steps_to_evaluate(matches) == [2, 3, 4, 6]
    # the plain arm stopped before the dynamic step: no equal-step match
    assert ds.match_steps(dynamic, plain[:2], [4])[0].equal_steps is None


def test_comparison_in_points_and_its_medians():
    dynamic = [ds.StepPoint(s, 200 * s, 3.0 * s) for s in range(1, 5)]
    plain = [ds.StepPoint(s, 128 * s, 2.0 * s) for s in range(1, 8)]
    matches = ds.match_steps(dynamic, plain, [2, 4])
    result = ds.comparison(matches, {2: 0.60, 4: 0.70}, {2: 0.55, 3: 0.58, 4: 0.62, 6: 0.66})
    first = result["per_step"][0]
    assert first["points_equal_samples"] == pytest.approx(2.0)
    assert first["points_equal_steps"] == pytest.approx(5.0)
    assert first["equal_samples"] == {"step": 3, "generated": 384, "wall_s": 6.0, "accuracy": 0.58}
    assert result["median_points_equal_samples"] == pytest.approx(3.0)  # +2 and +4
    assert result["median_points_equal_wall"] == pytest.approx(3.0)
    assert result["median_points_equal_steps"] == pytest.approx(6.5)  # +5 and +8
    rows = ds.table_rows({"comparison": result})
    assert rows[0][:2] == ["step 2: 400 samples, 6 s", "0.600"]
    assert rows[0][2] == "0.580 (step 3, 384, 6 s) +2.0"


def test_verdict_needs_a_gain_beyond_the_noise_on_every_task():
    def task(samples: float, wall: float) -> dict:
        return {"comparison": {"median_points_equal_samples": samples, "median_points_equal_wall": wall}}

    assert ds.verdict({"a": task(5.0, 1.0), "b": task(4.0, -2.0)}) == "gain"
    assert ds.verdict({"a": task(5.0, 1.0), "b": task(2.0, 1.0)}) == "no gain"  # within the noise on one task
    assert ds.verdict({"a": task(5.0, -6.0), "b": task(5.0, 0.0)}) == "no gain"  # well behind at equal wall
