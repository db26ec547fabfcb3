"""A judge's failed call (`judges.<name>.on_failure`): its samples score the fallback, or its group is dropped by the
rollout, counted, and another sampled in its place; the held-out evaluation scores a dropping judge's failure as
nothing and goes on."""

import asyncio
import itertools
import json

import httpx
import pytest

from app.evaluate import evaluate_async
from app.fleet_client import FleetClient
from app.rollout.judges import JudgeReward
from app.rollout.producer import GroupProducer, GroupsKeepFailing
from app.rollout.sampling import CompletionSampler
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, exact_answer
from contracts.retry import Backoff
from contracts.rollouts import Choice
from core.config import load_config
from tests.support.rollout_parts import PROBLEMS, run


class FlakyJudge:
    """A judge server that fails (503) the requests `fails(i)` picks and answers yes, no, yes, ... to the others."""

    def __init__(self, fails):
        self.fails, self.calls = fails, itertools.count()

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.fails(next(self.calls)):
            return httpx.Response(503, json={"error": "judge overloaded"})
        n = len(json.loads(request.content)["prompt"])
        verdicts = [
            {"index": i, "text": "yes" if i % 2 == 0 else "no", "finish_reason": "stop", "token_ids": []}
            for i in range(n)
        ]
        return httpx.Response(200, json={"choices": verdicts})


def judged(on_failure: str, fails, *overrides: str):
    """The run's config with judge `j` rewarding alone, and the judge as its scorer calls it."""
    judge = f"judges={{j: {{model: judge-model, template: '{{completion}}', on_failure: {on_failure}}}}}"
    cfg = load_config(
        None, [judge, "task.reward_funcs=[j]", "sampling.num_generations=4", "rollout.mode=sync", *overrides]
    )
    client = FleetClient(
        "http://judge.test", transport=httpx.MockTransport(FlakyJudge(fails).handler), backoff=Backoff(1, 0.0)
    )
    return cfg, JudgeReward("j", cfg.judges["j"], client)


async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
    return [Choice(i, [5, 6], [-0.1, -0.2], str(i), "stop") for i in range(n)]


def producer(cfg, judge, *funcs):
    sampler = CompletionSampler(generate, RewardScorer([*funcs, judge], timeout_s=5.0, workers=4))
    return GroupProducer(cfg, PROBLEMS, lambda p: [1, 2, 3], sampler)


def four_groups(cfg, judge):
    """The producer, once it has handed over four trained groups, and their batch."""

    async def take():
        p = producer(cfg, judge)
        try:
            return p, await p.get_groups(4)
        finally:
            await p.stop()

    return run(take())


def test_a_dropping_judges_failed_group_is_dropped_counted_and_another_sampled():
    p, batch = four_groups(*judged("drop", lambda i: i % 3 == 0))  # one request in three fails
    assert len(batch.groups) == 4
    assert all([s.reward for s in g.samples] == [1.0, 0.0] * 2 for g in batch.groups)  # only judged groups
    dropped = p.counters["dropped_judge_failed"]
    assert dropped >= 2 and p.counters["dropped_failed"] == 0
    assert p.stats().metrics()["rollout/dropped_judge_failed_total"] == dropped
    assert p.sampler.reward_metrics()["reward/errors/j"] == 4 * dropped  # its samples: the judge's errors


def test_a_fallback_judges_failed_group_is_scored_its_fallback_and_trained():
    p, batch = four_groups(*judged("fallback", lambda i: i % 3 == 0, "judges.j.fallback_score=-1"))
    rewards = [[s.reward for s in g.samples] for g in batch.groups]
    assert [-1.0] * 4 in rewards and [1.0, 0.0] * 2 in rewards  # failed, scored the fallback; judged
    assert p.counters["dropped_judge_failed"] == 0 and p.stats().metrics()["rollout/dropped_judge_failed_total"] == 0


def test_a_dropping_judge_that_always_fails_ends_the_run_in_one_line_instead_of_stalling_it():
    cfg, judge = judged("drop", lambda i: True, "rollout.max_failed_groups=3")

    async def main():
        p = producer(cfg, judge, exact_answer)  # another function scoring does not save the group
        try:
            with pytest.raises(GroupsKeepFailing, match="judge j failing to score it"):
                await p.get_groups(2)
        finally:
            await p.stop()

    run(main())


def test_the_evaluation_scores_a_dropping_judges_failure_as_nothing_and_goes_on():
    cfg, judge = judged("drop", lambda i: True)

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    sampler = CompletionSampler(generate, RewardScorer([exact_answer, judge], timeout_s=5.0))
    problems = [Problem("right", "?", "0", {}), Problem("wrong", "?", "7", {})]
    result = asyncio.run(evaluate_async(sampler, Tokenizer(), problems, "policy-v0", 8, 2))
    assert result["accuracy"] == 0.5  # exact_answer's alone: the judge's failure added nothing
    assert sampler.reward_metrics()["reward/errors/j"] == 2
