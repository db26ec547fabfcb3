"""The pure logic of `app.rollout.verifiers_episodes`: a verifiers trace as a sample (its trainable branch split at
its first model token, only model tokens masked in, NaN log-probs and versions elsewhere, verifiers' reward), a
group's shared prompt, and why an episode is lost. Traces and episodes are stand-ins with the attributes of
verifiers' `Trace`, `Branch`, `Episode` and `Error` that the module reads; real ones are played in
`tests/integration/test_verifiers.py`."""

import asyncio
import math
from contextlib import asynccontextmanager
from types import SimpleNamespace

from app.rollout.verifiers_episodes import common_prompt, failure_cause, lost_sample, trace_sample


def _branch(ids, mask, logprobs, trainable=True):
    return SimpleNamespace(token_ids=ids, sampled_mask=mask, logprobs=logprobs, trainable=trainable)


def _trace(branches, reward=1.0, errors=(), rewards=None, timeout=False):
    return SimpleNamespace(
        branches=branches,
        reward=reward,
        is_truncated=False,
        last_reply="46",
        num_turns=sum(
            1
            for b in branches[-1:]
            for i, m in enumerate(b.sampled_mask)
            if m and (i == 0 or not b.sampled_mask[i - 1])
        ),
        errors=list(errors),
        rewards=rewards if rewards is not None else {"correct": SimpleNamespace(score=reward)},
        is_timeout=timeout,
    )


def _episode(trace, errors=(), timeout=False):
    return SimpleNamespace(traces=[trace], errors=list(errors), is_timeout=timeout)


def _error(kind, message="boom"):
    return SimpleNamespace(type=kind, message=message)


# prompt [1, 2, 3], model turn [5, 6], the user's turn [7, 8], model turn [9]
TWO_TURNS = _branch(
    [1, 2, 3, 5, 6, 7, 8, 9],
    [False] * 3 + [True] * 2 + [False] * 2 + [True],
    [0.0] * 3 + [-0.5, -1.0] + [0.0] * 2 + [-2.0],
)


def test_a_trace_is_its_branch_split_at_the_first_model_token():
    converted = trace_sample(_trace([TWO_TURNS], reward=0.5), version=3)
    sample = converted.sample
    assert converted.prompt_ids == [1, 2, 3] and converted.lost is None
    assert sample.completion_ids == [5, 6, 7, 8, 9] and sample.completion_mask == [1, 1, 0, 0, 1]
    assert sample.model_token_ids() == [5, 6, 9]
    lps, versions = sample.sampling_logprobs, sample.streams["versions"]
    assert lps[:2] == [-0.5, -1.0] and lps[4] == -2.0 and all(math.isnan(x) for x in lps[2:4])
    assert versions[:2] == [3.0, 3.0] and versions[4] == 3.0 and all(math.isnan(x) for x in versions[2:4])
    assert (sample.reward, sample.num_turns, sample.turn_rewards, sample.text) == (0.5, 2, [0.0, 0.5], "46")


def test_the_last_trainable_branch_is_the_sample_and_the_others_are_counted():
    untrainable = _branch([1, 2, 4], [False, False, True], [0.0, 0.0, -0.1], trainable=False)
    converted = trace_sample(_trace([TWO_TURNS, untrainable]), 1)
    assert converted.sample.completion_ids == [5, 6, 7, 8, 9] and converted.branches_dropped == 0
    earlier = _branch([1, 2, 3, 4], [False] * 3 + [True], [0.0] * 3 + [-0.3])
    converted = trace_sample(_trace([earlier, TWO_TURNS]), 1)
    assert converted.sample.completion_ids == [5, 6, 7, 8, 9] and converted.branches_dropped == 1


def test_a_groups_prompt_is_what_its_kept_episodes_share_and_the_rest_is_context():
    a = trace_sample(_trace([_branch([1, 2, 3, 5], [0, 0, 0, 1], [0, 0, 0, -0.5])]), 1)
    b = trace_sample(_trace([_branch([1, 2, 4, 6], [0, 0, 0, 1], [0, 0, 0, -0.7])]), 1)
    lost = lost_sample("timeout")
    assert common_prompt([a, b, lost]) == [1, 2]
    assert a.sample.completion_ids == [3, 5] and a.sample.completion_mask == [0, 1]
    assert b.sample.completion_ids == [4, 6] and math.isnan(b.sample.sampling_logprobs[0])
    assert math.isnan(b.sample.streams["versions"][0]) and b.sample.streams["versions"][1] == 1.0
    assert lost.sample.completion_ids == [] and math.isnan(lost.sample.reward) and lost.sample.env_error


def test_an_episode_is_lost_by_the_first_cause_verifiers_recorded():
    good = _trace([TWO_TURNS])
    assert failure_cause(_episode(good)) is None
    assert failure_cause(_episode(good, timeout=True)) == "timeout"
    assert failure_cause(_episode(_trace([TWO_TURNS], timeout=True))) == "timeout"
    assert failure_cause(_episode(good, errors=[_error("EnvError")])) == "env_raised"
    assert failure_cause(_episode(_trace([TWO_TURNS], errors=[_error("TaskError")]))) == "task_raised"
    for said in (  # verifiers' words for a reward that returned a string, or None
        "task ArithmeticTask scoring: ValueError: could not convert string to float: 'forty-six'",
        "task T scoring: TypeError: float() argument must be a string or a real number, not 'NoneType'",
    ):
        assert failure_cause(_episode(_trace([TWO_TURNS], errors=[_error("TaskError", said)]))) == "reward_malformed"
    raised = _error("TaskError", "task T scoring: RuntimeError: the reward's grader is down")
    assert failure_cause(_episode(_trace([TWO_TURNS], errors=[raised]))) == "task_raised"
    assert failure_cause(_episode(_trace([TWO_TURNS], errors=[_error("ProviderError")]))) == "model_call"
    assert failure_cause(_episode(_trace([TWO_TURNS], errors=[_error("KeyError")]))) == "raised"
    assert failure_cause(_episode(_trace([_branch([1, 2], [False, False], [0.0, 0.0])]))) == "no_tokens"
    assert failure_cause(_episode(_trace([TWO_TURNS], rewards={"correct": None}))) == "unscored"
    assert failure_cause(_episode(_trace([TWO_TURNS], reward=math.nan))) == "reward_malformed"
    assert failure_cause(SimpleNamespace(traces=[], errors=[], is_timeout=False)) == "no_tokens"


class _Env:
    """A stand-in for verifiers' env: `serving` counted, slots played after a pause, every episode the same trace."""

    def __init__(self):
        self.entered = self.exited = 0
        self.live = False

    @asynccontextmanager
    async def serving(self):
        assert not self.live, "the env's serving resources are one set at a time"
        self.entered, self.live = self.entered + 1, True
        try:
            yield
        finally:
            self.exited, self.live = self.exited + 1, False

    def slots(self, task, n):
        return [task] * n

    async def run_slot(self, slot, ctx):
        assert self.live
        await asyncio.sleep(0.01)
        return _episode(_trace([TWO_TURNS]))


def test_groups_in_flight_together_share_one_serving_and_the_last_takes_it_down():
    from app.rollout.sampling import SamplingArgs
    from app.rollout.verifiers_episodes import VerifiersRunner
    from app.tasks.problems import Problem

    env = _Env()
    runner = VerifiersRunner(env, ["task"], "http://127.0.0.1:1", "model", None)
    runner.context = lambda model, sampling: None
    problem = Problem("p", "Compute 1+2. Answer: ", "3", {"vf_index": 0})

    async def groups(k):
        return await asyncio.gather(*(runner.sample(problem, [], "policy-v2", 2, SamplingArgs(4)) for _ in range(k)))

    sampled = asyncio.run(groups(3))
    assert (env.entered, env.exited) == (1, 1) and not env.live
    assert all(s.prompt_ids == [1, 2, 3] and len(s.samples) == 2 for s in sampled)
    assert sampled[0].samples[0].streams["versions"][0] == 2.0
    asyncio.run(groups(2))  # another loop (as each evaluation is): serving again, once
    assert (env.entered, env.exited) == (2, 2)


def test_the_runs_token_reaches_verifiers_client_as_its_header_and_never_the_environment(monkeypatch):
    """The token (the admin token on a fleet of the run's own) must not be inherited by the episode's subprocesses
    (verifiers' harnesses, model-driven tools): it is a header of the client verifiers builds, not a variable."""
    import os

    from openai._models import FinalRequestOptions
    from verifiers.v1.clients.base import build_async_openai

    from app.rollout.sampling import SamplingArgs
    from app.rollout.verifiers_episodes import API_KEY_VAR, VerifiersRunner

    monkeypatch.delenv(API_KEY_VAR, raising=False)
    runner = VerifiersRunner(_Env(), ["task"], "http://127.0.0.1:1", "model", None, token="run-token-5e2a9")
    assert "run-token-5e2a9" not in os.environ.values()
    client = build_async_openai(runner.context("policy-v1", SamplingArgs(4)).client)  # as verifiers builds it
    request = client._build_request(FinalRequestOptions.construct(method="post", url="/generate", json_data={}))
    assert request.headers["authorization"] == "Bearer run-token-5e2a9"


class _MeasuredEnv(_Env):
    """Every episode's trace carries the task's `@vf.metric`s as verifiers records them (None: a metric that failed)."""

    def __init__(self):
        super().__init__()
        self.lengths = iter([2.0, 4.0, 6.0])

    async def run_slot(self, slot, ctx):
        episode = await super().run_slot(slot, ctx)
        episode.traces[-1].metrics = {"length": next(self.lengths), "judge": None}
        return episode


def test_a_tasks_metrics_are_recorded_in_the_runs_metrics():
    """A taskset's `@vf.metric` was computed by verifiers and dropped: now its mean over a step's episodes is logged."""
    from app.rollout.sampling import SamplingArgs
    from app.rollout.verifiers_episodes import VerifiersRunner
    from app.tasks.problems import Problem

    runner = VerifiersRunner(_MeasuredEnv(), ["task"], "http://127.0.0.1:1", "model", None)
    runner.context = lambda model, sampling: None
    problem = Problem("p", "Compute 1+2. Answer: ", "3", {"vf_index": 0})
    asyncio.run(runner.sample(problem, [], "policy-v0", 3, SamplingArgs(4)))
    metrics = runner.reward_metrics()
    assert metrics["verifiers/metric/length"] == 4.0 and "verifiers/metric/judge" not in metrics
    assert "verifiers/metric/length" not in runner.reward_metrics()  # a step's figure: read once
