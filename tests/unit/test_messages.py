"""The typed messages: group ids from old checkpoints, the logged names of the stats."""

import json

import pytest

from app.learner.state import STATE_FILE, read_state
from contracts.rollouts import BatchStats, Group, Sample, parse_group_ids


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
        "samples": 4,
    }
    assert BatchStats.of([], learner_version=4) is None
