"""The tiny model that calls tools: its chat template under TRL's checks and parser, demonstrations laid out token for
token as the template renders the whole conversation, a wrong demonstration refused, greedy play batched in process,
and the config that asks for it."""

import asyncio
import random

import pytest
import torch

from app.tasks.problems import Problem, arithmetic_prompt
from app.tasks.trl_environments import ToolChat, tool_methods, tool_tokenizer
from core.chat_templates import END_OF_TURN
from core.config import RunConfig, TaskConfig, ToolWarmupConfig
from examples.trl_calculator import CalculatorEnv, demonstration
from tiny.folder import tiny_model_folder
from tiny.network import random_qwen2
from tiny.tokenizer import build_tokenizer
from tiny.tool_play import LocalGreedy, ToolPlay, turn_ids

TOOLS = ToolWarmupConfig(
    environment="examples.trl_calculator:CalculatorEnv", demonstration="examples.trl_calculator:demonstration"
)
TASK = TaskConfig(name="arithmetic", digits=2, reward_funcs=[])


def wrong_demonstration(row: dict) -> list[dict]:
    """Submits one more than the sum: a play its environment does not reward."""
    (add, submit, say) = demonstration(row)
    submit["tool_calls"][0]["function"]["arguments"]["answer"] += 1
    return [add, submit, say]


def additions(n: int, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]
    return [Problem(f"p{a}+{b}", arithmetic_prompt(a, b), str(a + b)) for a, b in pairs]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(2, 0, tools=True)


def test_the_tool_template_passes_trls_checks_and_its_turns_parse_back_with_trls_qwen_parser(tokenizer):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    assert tokenizer.eos_token == END_OF_TURN and tool_tokenizer(tokenizer) is tokenizer  # used as it is
    chat = ToolChat(tokenizer)
    assert chat.chat_template is None  # prefix-preserving: TRL keeps it for training
    env = CalculatorEnv()
    env.reset(answer="46")
    prompt = chat.prompt_ids([{"role": "user", "content": "Compute 12+34."}], tool_methods(env))
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nTools: add(a,b) submit(answer)<|im_end|>\n")
    for message in demonstration({"prompt": [{"role": "user", "content": "Compute 12+34."}]}):
        ids = turn_ids(tokenizer, message)
        assert ids[-1] == tokenizer.eos_token_id
        parsed = chat.parse(ids, prompt, tool_methods(env))
        assert parsed.get("tool_calls") == message.get("tool_calls") and parsed["content"] == message["content"]


def test_a_demonstration_is_laid_out_as_the_template_renders_the_whole_conversation(tokenizer):
    play = ToolPlay(tokenizer, TOOLS, TASK, max_episode_tokens=4096)
    problems = additions(3)
    for problem, (ids, mask) in zip(problems, play.demonstrations(problems), strict=True):
        a, b = map(int, problem.id[1:].split("+"))
        add, submit, say = demonstration({"prompt": [{"role": "user", "content": problem.prompt}]})
        conversation = [
            {"role": "user", "content": problem.prompt + " Use the tools, then submit."},
            add,
            {"role": "tool", "name": "add", "content": str(a + b)},
            submit,
            {"role": "tool", "name": "submit", "content": "submitted"},
            say,
        ]
        rendered = tokenizer.apply_chat_template(
            conversation, tools=tool_methods(CalculatorEnv()), tokenize=True, return_dict=False
        )
        assert ids == rendered[: len(ids)] and tokenizer.decode(rendered[len(ids) :]) == "\n"
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert trained == (
            f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|im_end|>'
            f'<tool_call>{{"name": "submit", "arguments": {{"answer": {a + b}}}}}</tool_call><|im_end|>'
            f"{a + b}<|im_end|>"
        )


def test_a_demonstration_that_its_environment_does_not_reward_is_refused(tokenizer):
    tools = TOOLS.model_copy(update={"demonstration": f"{__name__}:wrong_demonstration"})
    with pytest.raises(ValueError, match="is not a right play"):
        ToolPlay(tokenizer, tools, TASK, max_episode_tokens=4096).demonstrations(additions(2))


class CountingModel:
    """A stand-in for a causal LM's greedy `generate`: answers each row with its last token + 1, 2, ..., counts calls."""

    def __init__(self, stop_after: int, eos: int):
        self.calls, self.stop_after, self.eos = 0, stop_after, eos

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        self.calls += 1
        rows = []
        for row in input_ids.tolist():
            new = [row[-1] + k for k in range(1, max_new_tokens + 1)]
            rows.append(row + [self.eos if k == self.stop_after else t for k, t in enumerate(new)])
        return torch.tensor(rows)


def test_local_greedy_batches_requests_that_arrive_together_and_cuts_each_at_its_own_end():
    model = CountingModel(stop_after=3, eos=0)
    generate = LocalGreedy(model, eos_id=0)

    async def requests():
        return await asyncio.gather(
            generate([10, 11], "tiny", max_tokens=2),  # cut by its own max_tokens
            generate([[20], [30, 31, 32]], "tiny", n=2, max_tokens=8),  # a batch of prompts, n each: ends at eos
        )

    first, second = asyncio.run(requests())
    assert model.calls == 1  # one generate for both requests
    assert [c.token_ids for c in first] == [[12, 13]] and first[0].finish_reason == "length"
    assert [c.token_ids for c in second] == [[21, 22, 23, 0]] * 2 + [[33, 34, 35, 0]] * 2
    assert all(c.finish_reason == "stop" for c in second) and [c.index for c in second] == [0, 1, 2, 3]


def test_greedy_play_judges_a_model_by_its_environments_reward(tokenizer):
    model = random_qwen2(
        vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
    )  # fmt: skip
    play = ToolPlay(tokenizer, TOOLS, TASK, max_episode_tokens=4096)
    play.demonstrations(additions(1))  # sets the turn budget from the longest demonstrated turn
    assert play.greedy_accuracy(model, additions(4, seed=1)) == 0.0  # a random model never submits the sum
    assert model.training  # left as the warm-up had it


def test_a_tool_warm_up_must_be_played_in_the_runs_own_environment_and_has_a_cache_key_of_its_own():
    tools = {"environment": TOOLS.environment, "demonstration": TOOLS.demonstration}
    cfg = RunConfig(
        model={"tiny": {"warmup_tools": tools}}, env={"factory": TOOLS.environment}, task={"reward_funcs": []}
    )
    assert tiny_model_folder(cfg.model, cfg.task) != tiny_model_folder(RunConfig().model, cfg.task)
    with pytest.raises(ValueError, match="warmup_tools.environment"):
        RunConfig(model={"tiny": {"warmup_tools": tools}}, task={"reward_funcs": []})
    with pytest.raises(ValueError, match="expected module:callable"):
        ToolWarmupConfig(environment="examples.trl_calculator", demonstration=TOOLS.demonstration)


def test_the_tool_warm_ups_tokenizer_learns_the_format_so_a_whole_episode_fits_the_tiny_models_context(monkeypatch):
    import tiny.tools as tools
    from core.config import TinyModelConfig

    monkeypatch.setattr(tools, "TOOL_POOL", 64)
    tiny = TinyModelConfig(warmup_tools=TOOLS)
    heldout = additions(8, seed=2)
    tokenizer, plan = tools.tool_plan(tiny, TASK, heldout)
    examples = [plan.example(random.Random(k)) for k in range(16)]
    assert all(len(ids) <= 160 < tiny.max_position_embeddings for ids, _ in examples)  # ~130 tokens
    assert all(tokenizer.decode(ids).count("<tool_call>") == 2 for ids, _ in examples)
    held = {p.prompt for p in heldout}
    assert not any(p in tokenizer.decode(ids) for ids, _ in examples for p in held)  # held-out problems unseen
    with pytest.raises(ValueError, match="demonstrates additions"):
        tools.tool_plan(tiny, TaskConfig(name="chained_arithmetic"), heldout)
