"""The tiny model's recipe for arithmetic: fresh additions, the held-out ones skipped, judged by the exact answer; and
the chat warm-up (`model.tiny.warmup_chat`), the same additions under the chat template, as verifiers' renderers send
them."""

from __future__ import annotations

import random

from app.tasks.problems import Problem, arithmetic_prompt, make_arithmetic
from core.config import TaskConfig, TinyModelConfig
from core.models import prompt_token_ids
from tiny.recipe import TaskRecipe, Variant
from tiny.warmup import WarmUpData, WarmUpPlan, encode, greedy_accuracy, reference_example


def fresh_addition(rng: random.Random, limit: int, avoid: set[str], render=None) -> Problem | None:
    """A fresh addition (its prompt as `render` lays it out, if given), or None when it is held out."""
    a, b = rng.randrange(limit), rng.randrange(limit)
    prompt = arithmetic_prompt(a, b) if render is None else render(arithmetic_prompt(a, b))
    return None if prompt in avoid else Problem("", prompt, str(a + b))


def addition_example(
    tokenizer, rng: random.Random, limit: int, avoid: set[str], render=None
) -> tuple[list[int], list[int]] | None:
    """One supervised single-turn example of a fresh addition (token ids, loss mask), or None when it is held out."""
    problem = fresh_addition(rng, limit, avoid, render)
    return None if problem is None else reference_example(tokenizer, problem)


def chat_rendered(tokenizer):
    """A prompt as the chat template lays it out as one user message with the assistant's turn opened: the text whose
    tokens are exactly the ids of `apply_chat_template` (checked), so that a warm-up on it sees the prompt that a
    client rendering chat messages (verifiers' `renderers`) sends."""

    def render(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if encode(tokenizer, text) != prompt_token_ids(tokenizer, messages):
            raise ValueError("the chat template's text does not tokenize to its own ids")
        return text

    return render


class Arithmetic(TaskRecipe):
    """Additions of up to `task.digits` digits: generated afresh at each step, so no pool."""

    def data(self, task: TaskConfig, tiny: TinyModelConfig) -> WarmUpData:
        splits = make_arithmetic(task.digits, 1, task.num_heldout, task.seed)
        return WarmUpData(splits.heldout, splits.train)

    def plan(self, tokenizer, tiny, task, data, judge, render=None) -> WarmUpPlan:
        limit, avoid = 10**task.digits, {p.prompt for p in data.heldout}
        return WarmUpPlan(
            lambda rng: addition_example(tokenizer, rng, limit, avoid, render),
            lambda model: greedy_accuracy(model, tokenizer, data.heldout, max_new_tokens=task.digits + 2),
        )

    def chat(self, tokenizer, data: WarmUpData):
        render = chat_rendered(tokenizer)  # held-out additions rendered too, so that none is drawn
        return WarmUpData([Problem(p.id, render(p.prompt), p.answer) for p in data.heldout], data.train), render

    def draw(self, rng, task, data) -> Problem | None:
        return fresh_addition(rng, 10**task.digits, {p.prompt for p in data.heldout})


ARITHMETIC = Arithmetic()
# Warmed up on chat-rendered prompts (`Arithmetic.chat`).
CHAT = Variant("chat", ("warmup_chat",), lambda tiny: True if tiny.warmup_chat else None)
