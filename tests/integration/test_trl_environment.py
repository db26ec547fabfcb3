"""One TRL environment class (`examples/trl_calculator.py`), played by TRL's own rollout code and by spotrl's, compared
token by token.

TRL's side is, first, TRL 1.16's `GRPOTrainer` itself, built on a small random Qwen2 on the CPU: its
`_generate_and_score_completions` resets the environments, renders the prompts with their tools, parses the turns,
runs the tool loop (`_tool_call_loop`) and scores with `get_reward`; only `_generate_single_turn` (vLLM or
`generate`) answers fixed completions. Second, TRL 1.16's `AsyncGRPOTrainer` rollout loop (`trl.experimental.async_grpo.async_rollout_worker.
_AsyncRolloutLoop`): its `_generate_loop` resets the environments and folds their observations into the prompts,
`_generate_one` renders every turn through the chat template with the tools, parses it with `parse_response` and
runs the tools, and `_score_group` scores with `get_reward` and lays out the training rows. The two things replaced
are the HTTP call to vLLM (`_generate_one_turn`), which answers fixed completions, and the endless cycle over the
dataset (`_repeat_iterator`), which yields one group; spotrl's side gets the same completions
from a scripted fleet. Both use the tiny model's tokenizer made able to call tools (`tool_tokenizer`: TRL's Qwen2.5
template on the plain tiny tokenizer), and again the tool template of the tiny model built to call tools.
"""

import asyncio
import copy
import os
import queue
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop  # noqa: E402

from app.rollout.sampling import SamplingArgs  # noqa: E402
from app.rollout.tool_episodes import ToolEpisodeRunner  # noqa: E402
from app.tasks.problems import Problem  # noqa: E402
from app.tasks.trl_environments import ToolChat, tool_tokenizer  # noqa: E402
from contracts.rollouts import Choice  # noqa: E402
from examples.trl_calculator import CalculatorEnv  # noqa: E402
from tiny.network import random_qwen2  # noqa: E402
from tiny.tokenizer import build_tokenizer  # noqa: E402
from tiny.tool_play import turn_ids  # noqa: E402


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# The model's turns, in order: a tool call, two calls at once, an answer without a call; each sampled as the
# tokenizer's template renders it (`turn_ids`), as a model trained on that template samples it.
TURNS = [
    {"role": "assistant", "content": "", "tool_calls": [call("add", a=12, b=34)]},
    {"role": "assistant", "content": "", "tool_calls": [call("add", a=46, b=0), call("submit", answer=46)]},
    {"role": "assistant", "content": "The answer is 46."},
]
ROW = {"prompt": [{"role": "user", "content": "Compute 12+34."}], "answer": "46"}
PROBLEM = Problem("p", "Compute 12+34.", "46")
G = 3


@pytest.fixture(scope="module", params=["qwen2.5", "tiny-tools"])
def tokenizer(request):
    """TRL's Qwen2.5 template on the plain tiny tokenizer, and the tool template of the tiny model that calls tools."""
    return tool_tokenizer(build_tokenizer(2, 0, tools=request.param == "tiny-tools"))


def scripted_turn(tokenizer, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """The fixed completion of the turn this prompt asks for (its count of assistant headers), and log-probs."""
    turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant")
    ids = turn_ids(tokenizer, TURNS[turn - 1])
    return ids, [-0.01 * (k + 1) for k in range(len(ids))]


def trl_rollout(tokenizer, max_iterations):
    """One group of G rollouts by TRL's own loop; the prompts it sent, turn by turn, and its scored samples."""
    from accelerate.state import PartialState

    PartialState()  # as TRL's rollout child does before it builds the loop (`_child_main`)
    sent: list[list[int]] = []
    worker = _AsyncRolloutLoop(
        model_name="tiny",
        dataset=Dataset.from_list([ROW]),
        reward_funcs=[],
        processing_class=copy.deepcopy(tokenizer),
        eos_token_ids=[tokenizer.eos_token_id],
        rollout_buffer=queue.Queue(),
        model_version_value=SimpleNamespace(value=0),
        heartbeat_value=SimpleNamespace(value=0.0),
        failed_event=None,
        exception_info_queue=queue.Queue(),
        metrics_queue=queue.Queue(),
        environment_factory=CalculatorEnv,
        num_generations=G,
        max_inflight_tasks=G,
        max_tool_calling_iterations=max_iterations,
    )

    async def generate_one_turn(prompt_ids):  # in place of the POST to vLLM
        sent.append(list(prompt_ids))
        return scripted_turn(tokenizer, prompt_ids)

    worker._generate_one_turn = generate_one_turn

    def one_group():  # in place of the endless dataset cycle: the loop stops asking once the group's last is out
        for k in range(G):
            if k == G - 1:
                worker._stop_event.set()
            yield 0, ROW

    worker._repeat_iterator = one_group

    async def one_group():
        loop = asyncio.create_task(worker._generate_loop(stop_event=worker._stop_event))
        group = await worker._groups_to_score.get()
        await loop
        return await worker._score_group(group)

    samples = worker._loop.run_until_complete(one_group())
    worker._tool_pool.shutdown()
    return sent, samples


def spotrl_rollout(tokenizer, max_iterations):
    """The same group played by spotrl's runner against a scripted fleet."""
    sent: list[list[int]] = []

    async def fleet(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        prompts = prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]
        out = []
        for prompt in prompts:
            for i in range(n):
                sent.append(list(prompt))
                ids, logprobs = scripted_turn(tokenizer, prompt)
                out.append(Choice(i, ids, logprobs, tokenizer.decode(ids, skip_special_tokens=True), "stop"))
        return out

    runner = ToolEpisodeRunner(
        {None: CalculatorEnv},
        ToolChat(tokenizer),
        fleet,
        [],
        max_tool_calling_iterations=max_iterations,
        max_episode_tokens=4096,
        timeout_s=5.0,
    )
    try:
        sampled = asyncio.run(runner.sample(PROBLEM, [], "tiny", G, SamplingArgs(256)))
    finally:
        runner.close()
    return sent, sampled, runner


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_one_environment_class_gives_the_same_tokens_in_trl_and_in_spotrl(tokenizer, max_iterations):
    trl_sent, trl_samples = trl_rollout(tokenizer, max_iterations)
    spot_sent, sampled, runner = spotrl_rollout(tokenizer, max_iterations)

    turns = 3 if max_iterations is None else 2  # a second tool-calling turn is refused with one iteration
    assert len(trl_sent) == len(spot_sent) == G * turns
    # Every prompt the model was asked to continue, token by token (TRL sends each rollout's turn on its own).
    assert sorted(trl_sent) == sorted(spot_sent)
    assert all(tokenizer.decode(p).count(" Use the tools, then submit.") == 1 for p in spot_sent)

    # The training rows: the whole sequence, which tokens are the model's, their log-probs, and the reward.
    assert len(trl_samples) == G
    for trl, sample in zip(trl_samples, sampled.samples, strict=True):
        prompt = sampled.prompt_ids
        assert trl.input_ids.tolist() == prompt + sample.completion_ids
        assert trl.completion_mask.tolist() == [0] * len(prompt) + sample.completion_mask
        model_logprobs = [
            lp for lp, m in zip(trl.old_log_probs.tolist(), trl.completion_mask.tolist(), strict=True) if m
        ]
        assert model_logprobs == pytest.approx(
            [lp for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if m]
        )
        expected = 1.0 if max_iterations is None else 0.0  # one iteration: submit is never run
        assert trl.metrics["rewards/CalculatorEnv"] == sample.reward == expected
    assert runner.reward_metrics()["tools/calls_total"] == G * (3 if max_iterations is None else 1)
    assert sampled.samples[0].truncated == (max_iterations is not None)


def grpo_trainer_rollout(tokenizer, max_iterations, tmp_path):
    """One group of G rollouts by TRL's GRPOTrainer: the prompts it sent, its (prompt, completion, tool mask,
    log-probs) per rollout, and its reward metrics."""
    model = random_qwen2(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=G,
        num_generations=G,
        max_completion_length=1024,
        max_tool_calling_iterations=max_iterations,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[],
        args=args,
        train_dataset=Dataset.from_list([ROW] * G),
        processing_class=copy.deepcopy(tokenizer),
        environment_factory=CalculatorEnv,
    )
    sent: list[list[int]] = []

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """In place of vLLM or `generate`: a completion per prompt (GRPOTrainer repeats each prompt per generation)."""
        sent.extend(list(p) for p in prompt_ids)
        return tuple(map(list, zip(*(scripted_turn(tokenizer, p) for p in prompt_ids), strict=True)))

    trainer._generate_single_turn = generate_single_turn
    generated = {}
    generate = trainer._generate

    def keep(prompts):  # TRL's own `_generate`, its answer kept for the comparison
        generated["out"] = generate(prompts)
        return generated["out"]

    trainer._generate = keep
    trainer.model.train()
    trainer._generate_and_score_completions([dict(ROW) for _ in range(G)])
    prompt_ids, completion_ids, tool_mask, _, logprobs, *_ = generated["out"]
    return sent, list(zip(prompt_ids, completion_ids, tool_mask, logprobs, strict=True)), trainer._metrics["train"]


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_grpo_trainer_lays_the_episode_out_as_spotrl_does(tokenizer, max_iterations, tmp_path):
    trl_sent, rollouts, metrics = grpo_trainer_rollout(tokenizer, max_iterations, tmp_path)
    spot_sent, sampled, _ = spotrl_rollout(tokenizer, max_iterations)

    assert sorted(trl_sent) == sorted(spot_sent)
    for (prompt, completion, tool_mask, logprobs), sample in zip(rollouts, sampled.samples, strict=True):
        assert list(prompt) == sampled.prompt_ids
        assert list(completion) == sample.completion_ids
        assert list(tool_mask) == sample.completion_mask
        model_logprobs = [lp for lp, m in zip(logprobs, tool_mask, strict=True) if m]
        assert model_logprobs == pytest.approx(
            [lp for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if m]
        )
    expected = 1.0 if max_iterations is None else 0.0
    assert metrics["rewards/CalculatorEnv/mean"] == [expected]
    assert [s.reward for s in sampled.samples] == [expected] * G
