"""Partial rollouts and the staleness rules, on the producer with a fake fleet that can cut its requests."""

import asyncio
import math

import pytest

from app.rollout.episodes import EpisodeRunner
from app.rollout.producer import GroupProducer
from app.rollout.sampling import CompletionSampler
from app.rollout.staleness import StalenessRule, figures
from app.tasks.environments import ChainedArithmetic, Environment, EnvStep
from app.tasks.problems import make_arithmetic
from app.tasks.rewards import RewardScorer, exact_answer
from contracts.rollouts import Choice
from core.config import load_config

PROBLEMS = make_arithmetic(2, 200, 10, seed=0).train
PROMPT = [1, 2]


class CuttableFleet:
    """Generates a token every `tick` seconds, up to `max_tokens` (token id: 100 + its position in the completion);
    `cut(models)` aborts the requests in flight under those models, which answer at once with what they had."""

    def __init__(self, tick: float = 0.01, ticks: tuple[float, ...] = ()):
        self.tick, self.ticks = tick, list(ticks)  # `ticks`: the first requests' own, in order
        self.running: dict[str, set[asyncio.Event]] = {}
        self.models: list[str] = []  # the model of every request, in order
        self.cuts: list[list[str]] = []

    async def __call__(self, prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, **kw):
        prompts = prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]
        tick = self.ticks[len(self.models)] if len(self.models) < len(self.ticks) else self.tick
        self.models.append(model)
        cut = asyncio.Event()
        self.running.setdefault(model, set()).add(cut)
        made = 0
        try:
            while made < max_tokens and not cut.is_set():
                await asyncio.sleep(tick)
                made += 1
        finally:
            self.running[model].discard(cut)
        finish = "abort" if cut.is_set() and made < max_tokens else "length"
        out = []
        for prompt in prompts:
            done = len(prompt) - len(PROMPT)  # what the choice had before this request
            ids = [100 + done + j for j in range(made)]
            out += [Choice(i, ids, [-0.5] * made, "", finish) for i in range(n)]
        return out

    async def cut(self, models):
        self.cuts.append(list(models))
        for model in models:
            for event in self.running.get(model, ()):
                event.set()
        return {"cut": len(models)}

    def on_wire(self, model: str) -> bool:
        return bool(self.running.get(model))


def producer(fleet: CuttableFleet, sampler=None, **overrides) -> GroupProducer:
    sets = {
        "sampling.num_generations": 2,
        "sampling.max_completion_length": 40,
        "rollout.max_inflight_tasks": 2,
        "rollout.queue_maxsize": 8,
        **overrides,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    sampler = sampler or CompletionSampler(fleet, RewardScorer([exact_answer], timeout_s=2.0))
    return GroupProducer(cfg, PROBLEMS, lambda p: list(PROMPT), sampler, cut=fleet.cut)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_new_version_cuts_what_is_in_flight_and_the_continuation_carries_both_versions():
    async def main():
        fleet = CuttableFleet()
        w = producer(fleet, **{"rollout.partial_rollouts": "true"})
        w.start()
        await until(lambda: fleet.on_wire("policy-v0"))
        await asyncio.sleep(0.1)  # a few tokens under v0
        w.set_policy_version(1)
        await until(lambda: fleet.cuts)
        batch = await w.get_groups(2)
        stats = w.stats()
        await w.stop()
        return fleet, batch, stats

    fleet, batch, stats = run(main())
    assert fleet.cuts[0] == ["policy-v0"]
    first = batch.groups[0]
    assert first.policy_version == 0 and first.oldest_version == 0
    for sample in first.samples:
        versions = sample.token_versions()
        cut_at = versions.index(1)
        assert 0 < cut_at < 40 and versions == [0] * cut_at + [1] * (40 - cut_at)  # they switch at the cut
        assert sample.completion_ids == [100 + j for j in range(40)]  # token-exact across the cut
        assert len(sample.sampling_logprobs) == 40 and sample.truncated  # it ran to max_completion_length
    assert "policy-v1" in fleet.models
    batch_metrics = batch.stats().metrics()
    assert batch_metrics["sample/partial_share"] > 0 and batch_metrics["sample/versions_per_sample"] > 1
    assert batch.stats().staleness[0] == 1  # judged by its oldest token
    metrics = stats.metrics()
    assert metrics["rollout/cut_share"] > 0 and metrics["rollout/cuts_total"] >= 2
    assert metrics["rollout/prefilled_again_total"] >= 2 * (len(PROMPT) + 1)


def test_only_versions_at_least_partial_min_lag_behind_are_cut_and_none_without_partial_rollouts():
    async def main(partial: bool):
        fleet = CuttableFleet(tick=0.1, ticks=(0.1, 0.02))  # the second group is quicker than the first
        w = producer(fleet, **{"rollout.partial_rollouts": str(partial).lower(), "rollout.partial_min_lag": 2})
        w.start()
        await until(lambda: fleet.on_wire("policy-v0"))
        w.set_policy_version(1)  # one version behind: not cut
        await until(lambda: fleet.on_wire("policy-v1"))  # the quick group is done: the third starts under v1
        assert not fleet.cuts and fleet.on_wire("policy-v0")
        w.set_policy_version(2)  # v0 is two behind now, v1 one
        await asyncio.sleep(0.05)
        await w.stop()
        return fleet.cuts

    assert run(main(True)) == [["policy-v0"]]
    assert run(main(False)) == []


def test_bound_at_admission_admits_only_what_the_learner_takes_within_the_bound():
    rule = load_config(None, ["rollout.staleness_rule=bound_at_admission", "rollout.max_staleness=2"])
    assert StalenessRule.from_config(rule).admission_bound == 2 * 16  # max_staleness x weight_sync_steps x prompts
    assert StalenessRule.from_config(load_config(None, ["rollout.staleness_rule=drop_at_take"])).admission_bound is None

    async def main():
        fleet = CuttableFleet(tick=0.001)
        sets = {
            "rollout.staleness_rule": "bound_at_admission",
            "rollout.max_staleness": 1,
            "train.num_prompts_per_step": 3,
            "sampling.max_completion_length": 2,
            "rollout.max_inflight_tasks": 8,
            "rollout.queue_maxsize": 16,
        }
        w = producer(fleet, **sets)
        w.start()
        await until(lambda: w.queue.qsize() == 3)
        await asyncio.sleep(0.1)
        admitted = w.cursor  # nothing taken: three groups (one step of the learner's) and no more
        await w.get_groups(2)
        await until(lambda: w.queue.qsize() == 3)
        await asyncio.sleep(0.1)
        after_take = w.cursor
        await w.stop()
        return admitted, after_take

    assert run(main()) == (3, 5)


@pytest.mark.parametrize("rule, trained", [("drop_at_take", False), ("bound_at_admission", True)])
def test_finished_work_is_trained_under_the_hard_limit_with_bound_at_admission(rule, trained):
    cfg = load_config(
        None, [f"rollout.staleness_rule={rule}", "rollout.max_staleness=1", "rollout.hard_max_staleness=3"]
    )
    staleness = StalenessRule.from_config(cfg)
    assert staleness.too_stale(3, 0) is not trained  # past max_staleness, within the hard limit
    assert staleness.too_stale(4, 0) and not staleness.too_stale(1, 0)

    async def main():
        fleet = CuttableFleet(tick=0.001)
        sets = {
            "rollout.staleness_rule": rule,
            "rollout.max_staleness": 1,
            "rollout.hard_max_staleness": 3,
            "train.num_prompts_per_step": 2,
            "sampling.max_completion_length": 2,
            "rollout.queue_maxsize": 2,
        }
        w = producer(fleet, **sets)
        w.start()
        await until(lambda: w.queue.qsize() == 2)
        w.set_policy_version(3)  # the queued v0 groups are 3 versions behind
        batch = await w.get_groups(1)
        await w.stop()
        return batch, w.counters["dropped_stale"]

    batch, dropped = run(main())
    assert batch.groups[0].policy_version == (0 if trained else 3)  # trained as it is, or dropped for a fresh one
    assert (dropped == 0) is trained


def test_staleness_in_flight_and_in_the_queue_by_oldest_newest_and_token_mean():
    assert figures(5, []) is None
    queued = figures(5, [(2, 4, 3.0), (4, 4, 4.0)])
    assert (queued.count, queued.oldest, queued.oldest_max, queued.newest, queued.token_mean) == (2, 2.0, 3, 1.0, 1.5)
    assert queued.metrics("queue")["sample/staleness_oldest/queue"] == 2.0
    assert "sample/staleness_token_mean/inflight" not in figures(5, [(5, 5, None)]).metrics("inflight")

    async def main():
        fleet = CuttableFleet(tick=0.02)
        w = producer(fleet, **{"rollout.partial_rollouts": "true", "sampling.max_completion_length": 30})
        w.start()
        await until(lambda: fleet.on_wire("policy-v0"))
        await asyncio.sleep(0.1)
        w.set_policy_version(2)
        await until(lambda: fleet.on_wire("policy-v2"))
        stats = w.stats().metrics()
        await w.stop()
        return stats

    stats = run(main())
    assert stats["sample/staleness_oldest/inflight"] == 2.0  # every group in flight started under v0
    assert stats["sample/staleness_newest/inflight"] == 0.0  # ... and goes on under v2
    assert 0 < stats["sample/staleness_token_mean/inflight"] <= 2.0


class AlwaysOn(Environment):
    """Asks for three turns whatever the model says."""

    def reset(self, problem):
        self.turn = 0

    def step(self, text, token_ids):
        self.turn += 1
        return EnvStep(0.5, done=True) if self.turn == 3 else EnvStep(0.5, observation=[7, 7])


def episodes_producer(fleet, **overrides):
    runner = EpisodeRunner(AlwaysOn, lambda text: [7], fleet, max_turns=3, max_episode_tokens=64, timeout_s=2.0)
    sets = {"env.name": "chained_arithmetic", "sampling.max_completion_length": 3, **overrides}
    return producer(fleet, runner, **sets)


@pytest.mark.parametrize("partial", [True, False])
def test_later_turns_sample_under_the_newest_version_with_partial_rollouts(partial):
    async def main():
        fleet = CuttableFleet(tick=0.02)
        sets = {
            "rollout.partial_rollouts": str(partial).lower(),
            "rollout.staleness_rule": "bound_at_admission",
            "rollout.max_staleness": 1,
            "rollout.max_inflight_tasks": 1,
        }
        w = episodes_producer(fleet, **sets)
        w.start()
        await until(lambda: fleet.on_wire("policy-v0"))
        w.set_policy_version(2)  # during turn one: two versions ahead, past max_staleness, within the hard limit
        batch = await w.get_groups(1)
        await w.stop()
        return fleet, batch

    fleet, batch = run(main())
    group = batch.groups[0]
    assert group.policy_version == 0  # not stopped between turns for being stale: within the hard limit
    (sample, _) = group.samples
    versions = sample.streams["versions"]
    assert [math.isnan(v) for v in versions] == [m == 0 for m in sample.completion_mask]  # observations: none
    later = sample.token_versions()[3:]  # turns two and three
    assert later == ([2] * 6 if partial else [0] * 6)
    assert ("policy-v2" in fleet.models) is partial


def test_an_episode_past_the_hard_limit_is_stopped_between_turns():
    async def main():
        fleet = CuttableFleet(tick=0.02)
        sets = {
            "rollout.partial_rollouts": "true",
            "rollout.staleness_rule": "bound_at_admission",
            "rollout.max_staleness": 1,
            "rollout.hard_max_staleness": 2,
            "rollout.max_inflight_tasks": 1,
        }
        w = episodes_producer(fleet, **sets)
        w.start()
        await until(lambda: fleet.on_wire("policy-v0"))
        w.set_policy_version(3)
        batch = await w.get_groups(1)
        await w.stop()
        return batch, w.counters

    batch, counters = run(main())
    assert batch.groups[0].policy_version == 3 and counters["dropped_stale"] == 1 and counters["dropped_failed"] == 0


def test_the_staleness_settings_are_checked_against_each_other():
    with pytest.raises(ValueError, match="rollout.hard_max_staleness=1 is below rollout.max_staleness=2"):
        load_config(
            None,
            ["rollout.staleness_rule=bound_at_admission", "rollout.max_staleness=2", "rollout.hard_max_staleness=1"],
        )
    with pytest.raises(ValueError, match="bucket.keep_versions=8"):
        load_config(None, ["rollout.staleness_rule=bound_at_admission", "rollout.hard_max_staleness=8"])
    assert load_config(None, ["rollout.max_staleness=2"]).hard_max_staleness == 4  # twice max_staleness by default
    assert load_config(None, ["rollout.max_staleness=6"]).hard_max_staleness == 7  # ... below bucket.keep_versions (8)
    with pytest.raises(ValueError, match="partial_min_lag"):
        load_config(None, ["rollout.partial_min_lag=0"])


def test_a_slow_environment_answers_after_its_latency():
    import time

    from app.tasks.problems import Problem

    env = ChainedArithmetic(latency_s=0.2)
    env.reset(Problem("p", "Compute 1+2. Answer: ", "3", {"chain": [4]}))
    started = time.monotonic()
    assert env.step("3", []).observation == " Add 4. Answer: "
    assert time.monotonic() - started >= 0.2
    with pytest.raises(ValueError, match="latency_s"):
        ChainedArithmetic(latency_s=-1)
