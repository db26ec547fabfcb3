"""The typed messages: group ids from old checkpoints, the logged names of the stats."""

import json

import pytest

from app.learner.state import STATE_FILE, read_state
from contracts.rollouts import VERSIONS, BatchStats, Group, Sample, parse_group_ids


def test_checkpoints_with_string_group_ids_or_every_id_ever_trained_still_load(tmp_path):
    """Old checkpoints list every group id trained (once as "g<index>" strings) and no frontier: their data cursor is
    the frontier, below which every id is settled; the ids above it are kept."""
    state = {"step": 3, "policy_version": 3, "data_cursor": 9, "consumed_group_ids": ["g0", "g7", 12], "world_size": 1}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    loaded = read_state(tmp_path)
    assert (loaded.consumed_frontier, loaded.consumed_group_ids, loaded.data_cursor) == (9, [12], 9)
    consumed = loaded.resume_point().consumed()
    assert [gid for gid in range(14) if gid in consumed] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12]
    with pytest.raises(ValueError, match="group id 'step0-1'"):
        parse_group_ids(["step0-1"])


def test_consumed_groups_stay_a_frontier_and_a_few_ids_however_long_a_run_trains(tmp_path):
    """The rollout's producer and the learner's state (and so every checkpoint and resume point) keep the data
    frontier and the ids trained ahead of the oldest group still in flight, not every id ever trained."""
    import asyncio
    import random

    from app.learner.state import LearnerState, write_state
    from app.rollout.producer import GroupProducer
    from app.rollout.sampling import CompletionSampler
    from app.tasks.problems import Problem
    from app.tasks.rewards import RewardScorer, exact_answer
    from contracts.rollouts import Choice
    from core.config import load_config

    jitter = random.Random(0)

    async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        await asyncio.sleep(jitter.random() * 0.002)  # groups finish out of order
        if jitter.random() < 0.05:
            raise RuntimeError("a generation that fails: its group is lost, never trained")
        return [Choice(i, [4], [-0.1], "4", "stop") for i in range(n)]

    cfg = load_config(None, ["sampling.num_generations=2", "rollout.max_inflight_tasks=16", "rollout.queue_maxsize=16"])
    problems = [Problem(f"p{i}", "2+2=", "4") for i in range(50)]
    state = LearnerState()

    async def train(steps: int) -> list[int]:
        producer = GroupProducer(
            cfg, problems, lambda p: [1], CompletionSampler(generate, RewardScorer([exact_answer]))
        )
        producer.start()
        consumed, largest = state.consumed(), []
        trained = set()
        for _ in range(steps):
            batch = await producer.get_groups(4)
            assert not any(g.group_id in consumed for g in batch.groups)  # never trained twice
            for group in batch.groups:
                consumed.add(group.group_id)
                trained.add(group.group_id)
            consumed.advance(batch.data_cursor)
            state.set_consumed(consumed)
            largest.append(max(len(state.consumed_group_ids), len(producer.consumed.above)))
        await producer.stop()
        assert all(gid in consumed for gid in trained)
        return largest

    largest = asyncio.run(train(300))  # 1200 groups trained
    # The ids trained while the oldest group in flight was being sampled (16 in flight, 16 in the queue), not 1200.
    assert max(largest) < 100, max(largest)
    assert state.consumed_frontier > 1000
    write_state(tmp_path, state, world_size=1)
    assert len((tmp_path / STATE_FILE).read_bytes()) < 400  # every checkpoint's copy of it, too
    assert read_state(tmp_path).consumed() == state.consumed()


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
        "sample/groups": 2,
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
