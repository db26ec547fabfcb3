"""Episodes of TRL environments against a scripted fleet: what costs an episode (counted per cause) and what does
not, prompts that differ per episode, several environments by name, reward functions with `environments=`."""

import asyncio
import itertools
import math
import time

import pytest

from app.rollout.sampling import SamplingArgs
from app.rollout.tool_episodes import ToolEpisodeRunner
from app.tasks.problems import Problem
from app.tasks.trl_environments import ToolChat, tool_methods, tool_tokenizer
from contracts.rollouts import Choice
from examples.trl_calculator import CalculatorEnv
from tiny.tokenizer import build_tokenizer

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": 3}}\n</tool_call><|im_end|>'
PROBLEM = Problem("p", "Compute 1+2.", "3")


@pytest.fixture(scope="module")
def chat():
    return ToolChat(tool_tokenizer(build_tokenizer(2, 0)))


class ScriptedFleet:
    """Answers turn k with `turns[k - 1]`, recording every prompt it is asked to continue."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.prompts, self.requests = tokenizer, turns, [], 0

    async def __call__(self, prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        self.requests += 1
        prompts = prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]
        ids = self.tokenizer(self.turns[turn - 1], add_special_tokens=False)["input_ids"][:max_tokens]
        self.prompts += [list(p) for p in prompts]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [Choice(i, list(ids), [-0.5] * len(ids), text, "stop") for _ in prompts for i in range(n)]


def play(chat, factories, turns, reward_funcs=(), n=2, problem=PROBLEM, timeout_s=2.0, max_episode_tokens=4096):
    fleet = ScriptedFleet(chat.tokenizer, turns)
    runner = ToolEpisodeRunner(
        factories if isinstance(factories, dict) else {None: factories},
        chat,
        fleet,
        list(reward_funcs),
        max_tool_calling_iterations=None,
        max_episode_tokens=max_episode_tokens,
        timeout_s=timeout_s,
    )
    try:
        sampled = asyncio.run(runner.sample(problem, [], "m", n, SamplingArgs(128)))
    finally:
        runner.close()
    return sampled, runner.reward_metrics(), fleet


def test_an_episode_calls_tools_until_a_turn_calls_none_and_get_reward_scores_it(chat):
    sampled, metrics, fleet = play(chat, CalculatorEnv, [ADD, SUBMIT, "Done.<|im_end|>"])
    assert [s.reward for s in sampled.samples] == [1.0, 1.0]
    assert [s.num_turns for s in sampled.samples] == [3, 3]
    assert fleet.requests == 3  # one n=G request, then one per turn for the group
    assert metrics["tools/calls_total"] == 4 and metrics["env/errors/get_reward"] == 0
    sample = sampled.samples[0]
    text = chat.tokenizer.decode(
        [t for t, m in zip(sample.completion_ids, sample.completion_mask, strict=True) if not m]
    )
    assert "<tool_response>\n3\n</tool_response>" in text and "submitted" in text  # tool results: context, untrained
    assert all(not math.isnan(lp) for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if m)


class Flaky(CalculatorEnv):
    """Fails as the row's `mode` column says."""

    def reset(self, answer: str, mode: str = "", **row):
        if mode == "reset_raised":
            raise RuntimeError("no sandbox")
        if mode == "reset_timeout":
            time.sleep(1.0)
        if mode == "reset_malformed":
            return 42
        return super().reset(answer)

    def add(self, a: int, b: int) -> int:
        """Add two integers, slowly or not at all.

        Args:
            a: The first integer.
            b: The second integer.
        """
        if a == 1:
            raise ValueError("cannot add 1")
        time.sleep(1.0)
        return a + b


@pytest.mark.parametrize("cause", ["reset_raised", "reset_timeout", "reset_malformed"])
def test_a_failing_reset_costs_the_group_counted_by_cause(chat, cause):
    problem = Problem("p", "Compute 1+2.", "3", {"mode": cause})
    with pytest.raises(RuntimeError, match=f"failed to start \\({cause}\\)"):
        play(chat, Flaky, ["Done.<|im_end|>"], problem=problem, timeout_s=0.3)


def test_a_factory_that_fails_sometimes_costs_only_its_episodes(chat):
    made = itertools.count(1)  # episodes are made in threads: next() is atomic, a list's length would race

    def factory():
        if next(made) == 3:  # the probe at start, one episode's, then this one
            raise RuntimeError("sandbox quota")
        return CalculatorEnv()

    sampled, metrics, fleet = play(chat, factory, [SUBMIT, "Done.<|im_end|>"])
    assert metrics["env/errors/factory_raised"] == 1
    lost, played = sorted(sampled.samples, key=lambda s: s.env_error, reverse=True)
    assert lost.env_error and math.isnan(lost.reward) and lost.num_turns == 1  # a first turn, never scored
    assert played.reward == 1.0 and played.num_turns == 2


def test_a_tool_that_raises_is_fed_back_and_one_that_hangs_costs_its_episode(chat):
    sampled, metrics, _ = play(chat, Flaky, [ADD, SUBMIT, "Done.<|im_end|>"], timeout_s=0.3)
    assert metrics["tools/failures_total"] == 2 and [s.reward for s in sampled.samples] == [1.0, 1.0]
    text = chat.tokenizer.decode(sampled.samples[0].completion_ids)
    assert "{'error': 'cannot add 1'}" in text  # TRL's tool-failure message, read by the model
    hang = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 2}}\n</tool_call><|im_end|>'
    sampled, metrics, _ = play(chat, Flaky, [hang, SUBMIT], timeout_s=0.3)
    assert metrics["env/errors/tool_timeout"] == 2
    assert all(s.env_error and math.isnan(s.reward) for s in sampled.samples)


def test_an_unknown_tool_or_malformed_call_is_the_models_mistake_not_an_error(chat):
    unknown = '<tool_call>\n{"name": "multiply", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    sampled, metrics, _ = play(chat, CalculatorEnv, [unknown, "<tool_call>\n{oops</tool_call><|im_end|>"])
    assert metrics["tools/unknown_name_total"] == 2 and not any(k.startswith("env/errors/t") for k in metrics)
    assert [s.num_turns for s in sampled.samples] == [2, 2]  # the malformed call parses as text: the episode ends
    assert [s.reward for s in sampled.samples] == [0.0, 0.0]


class Coin(CalculatorEnv):
    """A reset whose observation differs per episode."""

    count = 0

    def reset(self, answer: str, **row) -> str:
        super().reset(answer)
        Coin.count += 1
        return " Heads." if Coin.count % 2 else " Tails, then more."


def test_prompts_that_differ_share_the_group_prompt_and_keep_their_rest_as_context(chat):
    sampled, _, fleet = play(chat, Coin, ["Done.<|im_end|>"])
    heads, tails = sampled.samples
    assert fleet.requests == 1 and len(fleet.prompts) == 2  # one request, a prompt per episode
    for sample, prompt in zip(sampled.samples, fleet.prompts, strict=True):
        rest = len(prompt) - len(sampled.prompt_ids)
        assert prompt == sampled.prompt_ids + sample.completion_ids[:rest]
        assert sample.completion_mask[:rest] == [0] * rest and sample.completion_mask[rest:] == [1] * (
            len(sample.completion_mask) - rest
        )
    assert chat.tokenizer.decode(fleet.prompts[0]).endswith("Heads.<|im_end|>\n<|im_start|>assistant\n")


def answered(completions, prompts, completion_ids, environments, answer, **_):
    """A reward function as TRL calls it: messages, and the episodes' environments."""
    return [
        float(env.submitted == int(a)) + 0.5 * (c[-1]["content"] == "Done.")
        for env, a, c in zip(environments, answer, completions, strict=True)
    ]


class Plain(CalculatorEnv):
    get_reward = None  # owns no reward: scored by the reward functions alone


def test_reward_functions_get_the_environments_and_several_environments_go_by_name(chat):
    factories = {"calc": CalculatorEnv, "plain": Plain}
    problem = Problem("p", "Compute 1+2.", "3", {"environment": "plain"})
    sampled, metrics, _ = play(chat, factories, [SUBMIT, "Done.<|im_end|>"], reward_funcs=[answered], problem=problem)
    assert [s.reward for s in sampled.samples] == [1.5, 1.5]  # CalculatorEnv's get_reward: not a Plain's
    problem = Problem("p", "Compute 1+2.", "3", {"environment": "calc"})
    sampled, _, _ = play(chat, factories, [SUBMIT, "Done.<|im_end|>"], reward_funcs=[answered], problem=problem)
    assert [s.reward for s in sampled.samples] == [2.5, 2.5]
    with pytest.raises(ValueError, match="not among the environments"):
        play(chat, factories, ["Done.<|im_end|>"], problem=PROBLEM)


def test_no_room_for_the_tool_results_ends_the_episode_truncated(chat):
    messages = [{"role": "user", "content": "Compute 1+2. Use the tools, then submit."}]
    prompt = chat.prompt_ids(messages, tool_methods(CalculatorEnv()))
    turn = chat.tokenizer(ADD, add_special_tokens=False)["input_ids"]
    sampled, _, _ = play(chat, CalculatorEnv, [ADD, SUBMIT], max_episode_tokens=len(prompt) + len(turn) + 5)
    assert all(s.truncated and s.num_turns == 1 and s.reward == 0.0 for s in sampled.samples)


def test_the_rollout_trains_on_the_prompt_the_environment_rendered(chat):
    from app.rollout.producer import GroupProducer
    from core.config import load_config
    from tests.support.rollout_parts import PROBLEMS, run

    sets = ["env.factory=examples.trl_calculator:CalculatorEnv", "sampling.num_generations=2"]
    # A turn's room: the tiny tokenizer spells a tool call in about 60 tokens.
    cfg = load_config(None, [*sets, "sampling.max_completion_length=200", "model.max_model_len=256"])
    fleet = ScriptedFleet(chat.tokenizer, [SUBMIT, "Done.<|im_end|>"])
    runner = ToolEpisodeRunner(
        {None: CalculatorEnv}, chat, fleet, [], max_tool_calling_iterations=None, max_episode_tokens=4096, timeout_s=2
    )
    producer = GroupProducer(cfg, PROBLEMS, lambda p: [1, 2, 3], runner)  # the plain prompt: not what is trained

    async def main():
        producer.start()
        batch = await producer.get_groups(1)
        await producer.stop()
        return batch.groups[0], producer.stats().metrics()

    group, metrics = run(main())
    problem = next(p for p in PROBLEMS if p.id == group.problem_id)
    messages = [{"role": "user", "content": problem.prompt + " Use the tools, then submit."}]
    assert group.prompt_ids == chat.prompt_ids(messages, tool_methods(CalculatorEnv()))
    assert group.prompt_ids in fleet.prompts  # what the fleet was asked to continue
    assert metrics["tools/calls_total"] >= 2 and metrics["env/errors_total"] == 0
    runner.close()


def test_trls_shipped_reward_functions_score_episodes_unchanged(chat):
    """`trl.rewards`' functions, as TRL ships them, score episodes as they score the same completions called as
    TRL's trainer calls them (by keyword, the row's columns beside them); `accuracy_reward` raised when the
    completions were passed by position."""
    from trl.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        think_format_reward,
    )

    funcs = [
        accuracy_reward,
        think_format_reward,
        get_cosine_scaled_reward(max_len=64),
        get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0),
        get_soft_overlong_punishment(max_completion_len=32, soft_punish_cache=16),
    ]
    answer = "<think>one and two</think>The sum is $\\boxed{3}$.<|im_end|>"
    problem = Problem("p", "Compute 1+2.", "3", {"solution": "$3$"})
    sampled, metrics, _ = play(chat, Plain, [answer], reward_funcs=funcs, problem=problem)
    assert not any(v for k, v in metrics.items() if k.startswith("reward/errors"))
    ids = sampled.samples[0].model_token_ids()
    completion = [chat.parse(ids, sampled.prompt_ids, [])]  # TRL's parse: the thinking apart from the content
    expected = [f(completions=[completion], completion_ids=[ids], solution=["$3$"])[0] for f in funcs]
    assert expected[0] == 1.0 and expected[2] > 0.5  # right, and short
    assert [s.reward for s in sampled.samples] == [pytest.approx(sum(expected))] * 2


def test_task_weights_weigh_the_reward_funcs_and_get_reward_weighs_one_as_in_trl(chat):
    from app.tasks.rewards import exact_answer

    runner = ToolEpisodeRunner(
        {None: CalculatorEnv},
        chat,
        ScriptedFleet(chat.tokenizer, []),
        [exact_answer],
        max_tool_calling_iterations=None,
        max_episode_tokens=64,
        timeout_s=1.0,
        reward_weights=[0.5],
    )
    try:
        assert runner.scorer.weights == [0.5, 1.0]  # exact_answer's, then CalculatorEnv's get_reward
    finally:
        runner.close()


def test_a_judge_among_the_reward_funcs_reads_the_whole_episode_its_tool_calls_and_results_included(chat):
    import json

    import httpx

    from app.fleet_client import FleetClient
    from app.rollout.judges import JudgeReward
    from contracts.retry import Backoff
    from core.config.judges import JudgeConfig

    prompts = []

    def judge(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base-model", "parent": None}]})
        prompts.extend(json.loads(request.content)["prompt"])
        return httpx.Response(
            200, json={"choices": [{"index": i, "text": "yes", "finish_reason": "stop"} for i in range(2)]}
        )

    def reward():
        client = FleetClient("http://judge.test", transport=httpx.MockTransport(judge), backoff=Backoff(1, 0.0))
        return JudgeReward("j", JudgeConfig(template="{transcript}\nlast: {completion}"), client)

    sampled, metrics, _ = play(chat, CalculatorEnv, [ADD, SUBMIT, "Done.<|im_end|>"], reward_funcs=[reward()])
    assert (
        prompts
        == [
            "user: Compute 1+2. Use the tools, then submit.\n"  # reset's observation joins the prompt
            'assistant: add({"a": 1, "b": 2})\ntool: 3\n'
            'assistant: submit({"answer": 3})\ntool: submitted\n'
            "assistant: Done.\nlast: Done."
        ]
        * 2
    )
    assert [s.reward for s in sampled.samples] == [2.0, 2.0]  # the judge's 1.0 and CalculatorEnv's get_reward
    assert metrics["judge/j/requests"] == 1 and metrics["judge/j/samples"] == 2
    # Its agreement with the held-out measure (`app.evaluate`) is asked of the episodes as they were judged in
    # training, not of their text (the turns run together, the tools' results unseen).
    from app.evaluate import agreements

    trained = list(prompts)
    assert agreements({"j": reward()}, [PROBLEM] * 2, sampled.samples, [True, False]) == {"j": 0.5}
    assert prompts == trained * 2
