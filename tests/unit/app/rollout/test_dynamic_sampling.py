"""Dynamic sampling (DAPO) in the group producer with a fake fleet: zero-variance groups dropped, counted, bounded."""

from app.rollout.producer import GroupProducer, zero_variance
from app.rollout.sampling import CompletionSampler
from app.tasks.rewards import RewardScorer
from contracts.rollouts import Choice, Group, Sample
from core.config import load_config
from tests.support.rollout_parts import PROBLEMS, run


def text_value(completions, **_) -> list[float]:
    """The completion's text read as its reward: the fake fleet decides each group's variance."""
    return [float(c) for c in completions]


def uniform_then_mixed(informative_every: int):
    """Every `informative_every`-th request gets completions with distinct rewards; the others all the same one."""
    state = {"n": 0}

    async def generate(prompt_ids, model, n, max_tokens, temperature, top_p=1.0, top_k=-1):
        state["n"] += 1
        mixed = informative_every and state["n"] % informative_every == 0
        return [Choice(i, [5, 6], [-0.1, -0.2], str(i if mixed else 1), "stop") for i in range(n)]

    return generate


def make_producer(generate, **overrides):
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    sampler = CompletionSampler(generate, RewardScorer([text_value], timeout_s=2.0))
    return GroupProducer(cfg, PROBLEMS, lambda p: [1, 2, 3], sampler)


def _group(rewards):
    return Group(0, "p", [1], 0, [Sample([5], [-0.1], r, False, "x") for r in rewards], 0.0)


def test_zero_variance_ignores_unscorable_samples():
    assert zero_variance(_group([1.0, 1.0, float("nan")]))
    assert zero_variance(_group([float("nan")] * 2))
    assert not zero_variance(_group([0.0, 1.0, float("nan")]))


def test_uninformative_groups_are_dropped_and_the_step_filled_with_informative_ones():
    async def main():
        p = make_producer(uniform_then_mixed(3), **{"rollout.dynamic_sampling": True, "rollout.mode": "sync"})
        p.start()
        batch = await p.get_groups(4)
        assert len(batch.groups) == 4 and not any(zero_variance(g) for g in batch.groups)
        c = p.counters  # groups are sampled concurrently: how many were dropped depends on the interleaving
        assert c["dropped_zero_variance"] >= 4 and c["dropped_zero_variance"] == c["zero_variance"]
        stats = p.stats()
        assert abs(stats.zero_variance_share - c["zero_variance"] / c["scored"]) < 1e-9
        assert stats.metrics()["rollout/dropped_zero_variance_total"] == c["dropped_zero_variance"]
        # The dropped groups' problems are consumed (the cursor went past them), not retried.
        assert p.cursor >= c["scored"] >= 4 + c["dropped_zero_variance"]
        await p.stop()

    run(main())


def test_a_task_with_no_informative_group_goes_on_after_the_bound():
    async def main():
        p = make_producer(
            uniform_then_mixed(0),
            **{"rollout.dynamic_sampling": True, "rollout.dynamic_sampling_max_extra": 2, "rollout.mode": "sync"},
        )
        p.start()
        batch = await p.get_groups(2)  # every group uniform: each third one is trained anyway
        assert len(batch.groups) == 2 and all(zero_variance(g) for g in batch.groups)
        assert p.counters["dropped_zero_variance"] >= 2  # at most 2 in a row, then one trained anyway
        assert p.stats().metrics()["sample/zero_variance_share"] == 1.0
        await p.stop()

    run(main())


def test_off_by_default_counts_without_dropping():
    async def main():
        p = make_producer(uniform_then_mixed(2), **{"rollout.mode": "sync"})
        p.start()
        batch = await p.get_groups(4)
        assert len(batch.groups) == 4 and p.counters["dropped_zero_variance"] == 0
        assert p.stats().zero_variance_share == 0.5
        await p.stop()

    run(main())
