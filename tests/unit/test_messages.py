"""The typed messages: group ids from old checkpoints, the logged names of the stats."""

import json

import pytest

from app.learner.state import STATE_FILE, read_state
from contracts.rollouts import VERSIONS, BatchStats, Group, Sample, parse_group_ids


def test_checkpoints_with_string_group_ids_still_load(tmp_path):
    state = {"step": 3, "policy_version": 3, "data_cursor": 9, "consumed_group_ids": ["g0", "g7", 12], "world_size": 1}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert read_state(tmp_path).consumed_group_ids == [0, 7, 12]
    with pytest.raises(ValueError, match="group id 'step0-1'"):
        parse_group_ids(["step0-1"])


def test_batch_stats_are_what_the_driver_logged():
    groups = [
        Group(0, "p0", [1], 2, [Sample([5], [-1.0], 1.0), Sample([5], [-1.0], 0.0)]),
        Group(1, "p1", [1], 4, [Sample([5], [-1.0], 1.0), Sample([5], [-1.0], 1.0)]),
    ]
    metrics = BatchStats.of(groups, learner_version=4).metrics()
    assert metrics == {
        "reward": 0.75,
        "reward_std": pytest.approx(0.4330127),
        "sample/staleness_mean": 1.0,
        "sample/staleness_max": 2,
        "sample/version_min": 2,
        "sample/version_max": 4,
        "sample/versions_per_sample": 1.0,
        "sample/partial_share": 0.0,
        "samples": 4,
    }
    assert BatchStats.of([], learner_version=4) is None


def test_a_group_is_as_stale_as_its_oldest_token_and_partial_samples_are_counted():
    nan = float("nan")
    cut = Sample([5, 6, 7], [-1.0] * 3, 1.0, streams={VERSIONS: [2.0, 3.0, 3.0]})  # cut at v2, continued at v3
    episode = Sample([5, 9, 6], [-1.0, nan, -1.0], 0.0, completion_mask=[1, 0, 1], streams={VERSIONS: [3.0, nan, 4.0]})
    whole = Sample([5], [-1.0], 0.0, streams={VERSIONS: [3.0]})
    groups = [Group(0, "p0", [1], 2, [cut, whole]), Group(1, "p1", [1], 3, [episode, whole])]
    assert [g.oldest_version for g in groups] == [2, 3]
    assert episode.token_versions() == [3, 4] and Sample([5], [-1.0], 0.0).token_versions() == []
    stats = BatchStats.of(groups, learner_version=5)
    assert stats.staleness == [3, 2] and (stats.version_min, stats.version_max) == (2, 4)
    metrics = stats.metrics()
    assert metrics["sample/versions_per_sample"] == 1.5 and metrics["sample/partial_share"] == 0.5
    assert stats.num_partial == 2
