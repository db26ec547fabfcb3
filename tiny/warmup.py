"""The tiny model's supervised warm-up, whatever the task: examples laid out as the rollout lays them out, steps until
held-out greedy accuracy, as the task's recipe judges it, crosses a target.

GRPO needs a base that is sometimes right and sometimes wrong, so that groups have mixed rewards; a random model is
never right, so the build warms it up to `model.tiny.warmup_target_accuracy` (the jump happens at a different step for
each seed). What each task trains on and how it is judged is its recipe's (`tiny.recipe`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, reward_columns
from core.config import ConfigError, ModelConfig, TaskConfig, TinyModelConfig

# Judges greedy completions of problems: (texts, problems, completion ids, truncated) -> one verdict per problem.
Judge = Callable[[list[str], list[Problem], list[list[int]], list[bool]], list[bool]]


@dataclass
class WarmUpPlan:
    """What a warm-up trains on and how it judges the model (a recipe's `plan`)."""

    example: Callable[[random.Random], tuple[list[int], list[int]] | None]  # (ids, loss mask), None: held out
    accuracy: Callable[[object], float]  # the model's greedy held-out accuracy


@dataclass
class WarmUpData:
    """A task's problems as a warm-up sees them: the held-out split that evaluation uses and the warm-up must never
    see, the train split, and the pool a task with reference answers draws its examples from (none held out)."""

    heldout: list[Problem]
    train: list[Problem] = field(default_factory=list)
    pool: list[Problem] = field(default_factory=list)


def exactly_the_answer(texts: list[str], problems: list[Problem], completion_ids, truncated) -> list[bool]:
    return [t.strip() == p.answer for t, p in zip(texts, problems, strict=True)]


def rewarded(scorer) -> Judge:
    """A judge by the task's reward functions (`app.tasks.rewards.RewardScorer`), as evaluation judges a greedy
    sample: a positive summed reward, with the columns the rollout gives them."""

    def judge(texts, problems, completion_ids, truncated) -> list[bool]:
        columns = reward_columns(problems, truncated)
        scores = scorer.score(texts, [p.prompt for p in problems], completion_ids, columns)
        return [r > 0 for r in scores.rewards]

    return judge


@contextmanager
def rewards_judge(task: TaskConfig) -> Iterator[Judge]:
    """A judge by the task's reward functions, their scorer closed after."""
    scorer = RewardScorer.from_names(task.reward_funcs, task.reward_timeout_s, weights=task.weights())
    try:
        yield rewarded(scorer)
    finally:
        scorer.close()


@torch.no_grad()
def greedy_completions(
    model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 256
) -> list[tuple[str, list[int]]]:
    """Each prompt's greedy completion: its text and its ids up to EOS, as the fleet returns them (plain PyTorch, no
    vLLM)."""
    model.eval()
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    out: list[tuple[str, list[int]]] = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        generated = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos, eos_token_id=eos
        )
        new = generated[:, enc["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        out += [
            (t, row[: row.index(eos) + 1] if eos in row else row) for t, row in zip(texts, new.tolist(), strict=True)
        ]
    model.train()
    return out


def greedy_accuracy(
    model,
    tokenizer,
    problems: list[Problem],
    max_new_tokens: int,
    batch_size: int = 256,
    judge: Judge = exactly_the_answer,
) -> float:
    """Share of problems whose greedy completion `judge` accepts, by default exactly the answer."""
    eos = tokenizer.eos_token_id
    correct = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        done = greedy_completions(model, tokenizer, [p.prompt for p in chunk], max_new_tokens, batch_size)
        texts, ids = [t for t, _ in done], [row for _, row in done]
        correct += sum(judge(texts, chunk, ids, [eos not in row for row in ids]))
    return correct / len(problems)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_example(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """One supervised single-turn example (token ids, loss mask): the prompt and its reference completion closed by
    EOS, each tokenised on its own as the rollout tokenises a prompt and the fleet samples after it; loss on the
    completion."""
    p_ids = encode(tokenizer, problem.prompt)
    c_ids = encode(tokenizer, problem.reference) + [tokenizer.eos_token_id]
    return p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids)


def warm_up(
    model, tokenizer, tiny: TinyModelConfig, plan: WarmUpPlan, log=print, target: float | None = None, part: int = 1
) -> tuple[float, int]:
    """Supervised steps on the plan's examples until the model's held-out greedy accuracy, as the plan judges it,
    crosses the target (`tiny.warmup_target_accuracy` unless given); `part` seeds its data apart from other parts."""
    target = tiny.warmup_target_accuracy if target is None else target
    rng = random.Random(tiny.seed + part)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.warmup_lr)
    eos = tokenizer.eos_token_id
    acc, step = 0.0, 0
    for step in range(1, tiny.warmup_max_steps + 1):
        rows, masks = [], []
        while len(rows) < tiny.warmup_batch_size:
            example = plan.example(rng)
            if example is not None:
                rows.append(example[0])
                masks.append(example[1])
        width = max(map(len, rows))
        ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            acc = plan.accuracy(model)
            log(
                f"warm-up{'' if part == 1 else f' part {part}'} step {step}: loss {loss.item():.3f} held-out accuracy {acc:.3f}"
            )
            if acc >= target:
                break
    if acc < target:  # the run would start from a weaker model than asked for, and nothing else would say so
        log(
            f"warm-up{'' if part == 1 else f' part {part}'} ended below its target: held-out accuracy {acc:.3f} < "
            f"{target:.3f} after model.tiny.warmup_max_steps={tiny.warmup_max_steps} steps"
        )
    return acc, step


def check_context(tokenizer, model_cfg: ModelConfig, problems: list[Problem]) -> None:
    """ConfigError naming `model.max_model_len` when a problem and its reference completion do not fit the context
    the fleet serves: a prompt too long for it would fail every request that holds it, mid-run."""
    longest = max(len(reference_example(tokenizer, p)[0]) for p in problems)
    if longest > model_cfg.max_model_len:
        raise ConfigError(
            f"model.max_model_len={model_cfg.max_model_len}: the task's longest problem takes {longest} tokens with "
            "its reference answer"
        )
