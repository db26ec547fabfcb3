"""Tool episodes for the tiny model's warm-up (`model.tiny.warmup_tools`): demonstrations laid out as the rollout lays
out an episode, and greedy episodes played in this process to judge the model.

A model that is to learn from a TRL environment's tool episodes (`env.factory`) must first call tools at all; a
pretrained instruct model does, the tiny model built here does not. Its warm-up plays the config's demonstrations (a
dataset row -> the assistant messages of a right play) through the environment itself, with the rollout's own
episode runner (`app.rollout.tool_episodes.ToolEpisodeRunner`), so that each example is token for token what the
rollout would make of that play: the prompt rendered with the tools, the model's turns, the results the environment's
tools returned, laid out by TRL's `_get_tool_suffix_ids`. The same runner, answered by the model in this process,
plays the held-out problems greedily to judge it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from app.rollout.sampling import SamplingArgs
from app.rollout.tool_episodes import ToolEpisodeRunner, trl_row
from app.tasks.problems import Problem
from app.tasks.registry import resolve_named
from app.tasks.rewards import resolve_reward
from app.tasks.trl_environments import ToolChat, resolve_factories
from contracts.rollouts import Choice
from core.config import TaskConfig, ToolWarmupConfig

# The environment's calls (factory, reset, tools) in a warm-up: as generous as a run's default.
TOOL_TIMEOUT_S = 5.0


def turn_ids(tokenizer, message: dict) -> list[int]:
    """The tokens of one assistant message as the model would sample them: what the template renders after the
    assistant's header, up to and with its end of turn."""
    head = [{"role": "user", "content": ""}]
    opened = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(head + [message], tokenize=True, return_dict=False)
    rest = full[len(opened) :]
    if full[: len(opened)] != opened or tokenizer.eos_token_id not in rest:
        raise ValueError("the chat template does not render an assistant turn after its own header, closed by EOS")
    return rest[: rest.index(tokenizer.eos_token_id) + 1]


@torch.no_grad()
def greedy_continuations(
    model, rows: list[list[int]], max_new_tokens: int, eos_id: int, batch_size: int = 256
) -> list[list[int]]:
    """Each row's greedy continuation by a transformers model (`max_new_tokens` long, EOS-padded after an EOS), the
    rows left-padded with EOS into batches of `batch_size`."""
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[eos_id] * (width - len(r)) + r for r in chunk])
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
        new = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos_id,
            eos_token_id=eos_id,
        )[:, width:]
        out += new.tolist()
    return out


class ScriptedTurns:
    """A `Generate` that answers from scripts: the model name picks an episode's script, the turn its next message."""

    def __init__(self):
        self.scripts: dict[str, list[list[int]]] = {}

    async def __call__(self, prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=1):
        script = self.scripts[model]
        if turn > len(script):
            raise ValueError(f"{model}: the demonstration ended ({len(script)} turns) while its episode goes on")
        ids = script[turn - 1]
        return [Choice(i, list(ids), [0.0] * len(ids), "", "stop") for i in range(n)]


class LocalGreedy:
    """A `Generate` over a transformers model in this process, greedy. Requests that arrive within `window_s` of each
    other go through the model as one batch, so that the turns of every episode under way take one `generate`."""

    def __init__(self, model, eos_id: int, window_s: float = 0.02, batch_size: int = 256):
        self.model, self.eos_id, self.window_s, self.batch_size = model, eos_id, window_s, batch_size
        self.pending: list[tuple[list[list[int]], int, int, asyncio.Future]] = []
        self.lock = asyncio.Lock()

    async def __call__(self, prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=1):
        loop = asyncio.get_running_loop()
        prompts = [prompt_ids] if prompt_ids and isinstance(prompt_ids[0], int) else prompt_ids
        future = loop.create_future()
        self.pending.append((prompts, n, max_tokens, future))
        if len(self.pending) == 1:
            loop.call_later(self.window_s, lambda: loop.create_task(self._flush()))
        return await future

    async def _flush(self) -> None:
        batch, self.pending = self.pending, []
        rows = [p for prompts, _, _, _ in batch for p in prompts]  # greedy: a prompt's n choices are the same
        try:
            async with self.lock:
                outs = await asyncio.to_thread(self._generate, rows, max(m for _, _, m, _ in batch))
        except Exception as e:
            for *_, future in batch:
                future.set_exception(e)
            return
        k = 0
        for prompts, n, max_tokens, future in batch:
            choices = []
            for _ in prompts:
                ids, k = outs[k][:max_tokens], k + 1
                stopped = self.eos_id in ids
                ids = ids[: ids.index(self.eos_id) + 1] if stopped else ids
                reason = "stop" if stopped else "length"
                choices += [Choice(len(choices) + j, list(ids), [0.0] * len(ids), "", reason) for j in range(n)]
            future.set_result(choices)

    def _generate(self, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return greedy_continuations(self.model, rows, max_new_tokens, self.eos_id, self.batch_size)


class ToolPlay:
    """Episodes of the warm-up's environment rendered with `tokenizer`: demonstrated (`demonstrations`) or played
    greedily by a model (`greedy_accuracy`), both by the rollout's runner."""

    def __init__(self, tokenizer, tools: ToolWarmupConfig, task: TaskConfig, max_episode_tokens: int):
        self.tokenizer, self.task, self.max_episode_tokens = tokenizer, task, max_episode_tokens
        self.factories = resolve_factories(tools.environment)
        self.demonstrate: Callable[[dict], list[dict]] = resolve_named(
            tools.demonstration, {}, "demonstration", "module:callable"
        )
        self.longest_turn = 1

    def _runner(self, generate) -> ToolEpisodeRunner:
        return ToolEpisodeRunner(
            self.factories,
            ToolChat(self.tokenizer),
            generate,
            [resolve_reward(name) for name in self.task.reward_funcs],
            max_tool_calling_iterations=None,
            max_episode_tokens=self.max_episode_tokens,
            timeout_s=TOOL_TIMEOUT_S,
            reward_timeout_s=self.task.reward_timeout_s,
        )

    def demonstrations(self, problems: list[Problem]) -> list[tuple[list[int], list[int]]]:
        """Each problem's demonstration played in its environment: (token ids, loss mask on the model's turns).
        ValueError for a demonstration its episode does not reward, which would teach a wrong play."""
        scripts = ScriptedTurns()
        for i, problem in enumerate(problems):
            scripts.scripts[f"demo-{i}"] = [turn_ids(self.tokenizer, m) for m in self.demonstrate(trl_row(problem))]
        self.longest_turn = max([self.longest_turn] + [len(t) for s in scripts.scripts.values() for t in s])
        runner = self._runner(scripts)
        room = SamplingArgs(self.max_episode_tokens)

        async def play():
            return await asyncio.gather(*(runner.sample(p, [], f"demo-{i}", 1, room) for i, p in enumerate(problems)))

        try:
            played = asyncio.run(play())
        finally:
            runner.close()
        examples = []
        for problem, sampled in zip(problems, played, strict=True):
            (sample,) = sampled.samples
            if not sample.reward > 0 or sample.truncated:
                raise ValueError(
                    f"the demonstration of {problem.prompt!r} is not a right play (reward {sample.reward}, "
                    f"truncated {sample.truncated}, environment errors {dict(runner.counters)}, reward errors "
                    f"{sampled.reward_errors})"
                )
            examples.append(
                (
                    sampled.prompt_ids + sample.completion_ids,
                    [0] * len(sampled.prompt_ids) + list(sample.completion_mask),
                )
            )
        return examples

    def greedy_accuracy(self, model, problems: list[Problem]) -> float:
        """Share of `problems` whose greedy episode the environment rewards, `model` answering in this process, each
        turn given the longest demonstrated turn (`demonstrations` first) and two tokens more."""
        runner = self._runner(LocalGreedy(model, self.tokenizer.eos_token_id))
        turn = SamplingArgs(self.longest_turn + 2, temperature=0.0)

        async def play():
            return await asyncio.gather(*(runner.sample(p, [], "tiny", 1, turn) for p in problems))

        model.eval()
        try:
            played = asyncio.run(play())
        finally:
            runner.close()
            model.train()
        return sum(s.samples[0].succeeded for s in played) / len(problems)
