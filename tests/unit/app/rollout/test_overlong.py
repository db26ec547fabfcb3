"""Overlong shaping (DAPO): the soft penalty's shape, truncated samples masked, and the producer's counts."""

import math

import pytest

from app.rollout.overlong import OverlongShaping, overlong_penalty
from app.rollout.producer import GroupProducer
from app.rollout.sampling import CompletionSampler
from app.tasks.rewards import RewardScorer
from contracts.rollouts import Choice, Group, Sample
from core.config import load_config
from tests.support.rollout_parts import PROBLEMS, run


def test_the_penalty_is_zero_before_the_buffer_then_linear_to_the_limit():
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == -0.5
    assert overlong_penalty(100, 100, 20, 0.5) == -0.5
    assert overlong_penalty(130, 100, 20, 1.0) == -1.0  # past the limit (a continuation's overrun): capped
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # no buffer: off


def test_a_buffer_as_long_as_the_limit_is_refused():
    with pytest.raises(ValueError, match="overlong_buffer"):
        load_config(None, ["sampling.max_completion_length=6", "rollout.overlong_buffer=6"])


def _group():
    return Group(
        0,
        "p",
        [1],
        0,
        [
            Sample([5] * 4, [-0.1] * 4, 1.0, False),
            Sample([5] * 9, [-0.1] * 9, 1.0, False),
            Sample([5] * 10, [-0.1] * 10, 0.0, True),
            Sample([5] * 10, [-0.1] * 10, 1.0, True, completion_mask=[1] * 10),  # an episode: left alone
        ],
    )


def test_shaping_penalises_near_the_limit_and_masks_truncated_samples():
    g = _group()
    assert OverlongShaping(10, buffer=2, factor=1.0).apply(g) == (2, 0)
    assert [s.reward for s in g.samples] == [1.0, 0.5, -1.0, 1.0]
    g = _group()
    assert OverlongShaping(10, buffer=2, mask_truncated=True).apply(g) == (1, 1)
    assert g.samples[1].reward == 0.5 and math.isnan(g.samples[2].reward) and g.samples[3].reward == 1.0
    assert not OverlongShaping(10).active


def test_the_producer_shapes_and_counts():
    async def generate(prompt_ids, model, n, max_tokens, temperature, top_p=1.0, top_k=-1):
        return [Choice(i, [5] * max_tokens, [-0.1] * max_tokens, "x", "length") for i in range(n)]

    def one(completions, **_):
        return [1.0] * len(completions)

    async def main():
        sets = ["rollout.mode=sync", "rollout.mask_truncated=true", "sampling.max_completion_length=8"]
        cfg = load_config(None, sets)
        p = GroupProducer(
            cfg, PROBLEMS, lambda p: [1, 2, 3], CompletionSampler(generate, RewardScorer([one], timeout_s=2.0))
        )
        p.start()
        batch = await p.get_groups(1)
        assert all(math.isnan(s.reward) for s in batch.groups[0].samples)
        n = cfg.sampling.num_generations
        assert p.stats().metrics()["rollout/truncated_masked_total"] >= n
        await p.stop()

    run(main())
