"""What a recipe of the tiny model is: how it is warmed up on one kind of task (`TaskRecipe`), and a warm-up that
`model.tiny` switches on beside it (`Variant`). `tiny.recipes` lists them; nothing else tells tasks apart.

A recipe says what its build depends on beyond the shape and the held-out split (its part of the folder's key), where
its problems come from, what its tokenizer learns from, how a greedy completion is judged and what the warm-up trains
on. A variant says which `model.tiny` fields switch it on and its part of the key; a variant that builds otherwise
(a self teacher's context, tool episodes) gives its build.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.tasks.problems import Problem
from core.config import ConfigError, ModelConfig, TaskConfig, TinyModelConfig
from tiny.tokenizer import build_tokenizer
from tiny.warmup import Judge, WarmUpData, WarmUpPlan, exactly_the_answer

# A built model, before it is saved: (model, tokenizer, what the build measured).
Built = tuple[object, object, dict]
# The tiny model of another config, built first if it is not cached: (its folder, what its build measured).
Plain = Callable[..., tuple[Path, dict]]


class TaskRecipe:
    """How the tiny model is warmed up on one kind of task; the defaults are a single-turn task's, judged by the exact
    answer, its tokenizer learned from generated additions."""

    single_turn: bool = True  # a self teacher's context (`model.tiny.warmup_context`) is shown to single-turn tasks

    def key(self, task: TaskConfig) -> dict[str, Any]:
        """What the build reads of the task beyond its digits, seed and held-out split (the folder's key)."""
        return {}

    def data(self, task: TaskConfig, tiny: TinyModelConfig) -> WarmUpData:
        """The task's problems as the warm-up sees them."""
        raise NotImplementedError

    def tokenizer(self, model_cfg: ModelConfig, task: TaskConfig, data: WarmUpData):
        """The tokenizer, its pieces learned from the task's text."""
        return build_tokenizer(task.digits, model_cfg.tiny.seed)

    def judge(self, task: TaskConfig) -> AbstractContextManager[Judge]:
        """How a greedy completion of a held-out problem is judged, for the length of the warm-up."""
        return nullcontext(exactly_the_answer)

    def plan(
        self, tokenizer, tiny: TinyModelConfig, task: TaskConfig, data: WarmUpData, judge: Judge, render=None
    ) -> WarmUpPlan:
        """What the warm-up trains on and how it judges the model; `render` lays out a prompt (a chat warm-up)."""
        raise NotImplementedError

    def chat(self, tokenizer, data: WarmUpData) -> tuple[WarmUpData, Callable[[str], str]]:
        """The data with its held-out prompts under the chat template, and the render that lays them out so."""
        raise ValueError("model.tiny.warmup_chat: the chat warm-up is arithmetic's (task.name: arithmetic)")

    def draw(self, rng: random.Random, task: TaskConfig, data: WarmUpData) -> Problem | None:
        """A problem to train on (None: one that is held out), for a warm-up that shows it otherwise."""
        raise ConfigError("model.tiny.warmup_context: the warm-up shows a context to single-turn tasks only")


@dataclass(frozen=True)
class Variant:
    """A warm-up that `model.tiny` switches on beside the task's own: the fields that say so, its part of the
    folder's key (None: off), and its build where it builds otherwise (else the task's recipe, told by the fields)."""

    name: str
    fields: tuple[str, ...]
    key: Callable[[TinyModelConfig], Any]
    build: Callable[[ModelConfig, TaskConfig, Callable[[str], None], Plain], Built] | None = None

    def on(self, tiny: TinyModelConfig) -> bool:
        return self.key(tiny) is not None


def warmed_further(model_cfg: ModelConfig, task_cfg: TaskConfig, log, plain: Plain, *off: str):
    """A variant's starting point: the same config's model with the variant's fields `off` (None), which `plain`
    builds if it is not cached, loaded to train on; (model, tokenizer, what its build measured, as the variant's
    build reports it under `warmed_from` and `warmup_steps`)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from core.models import load_tokenizer

    tiny = model_cfg.tiny.model_copy(update=dict.fromkeys(off))
    folder, info = plain(model_cfg.model_copy(update={"tiny": tiny}), task_cfg, log=log)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    origin = {
        "warmed_from": {"folder": folder.name, "heldout_accuracy": info["heldout_accuracy"]},
        "warmup_steps": info["warmup_steps"],
    }
    return model, load_tokenizer(folder), origin
