"""The tool warm-up (`model.tiny.warmup_tools`): a tiny model that calls tools, for a run of TRL's `environment_factory`
kind (`app.kinds.trl_kind`). Its tokenizer gets the tool chat template, its pieces learned from demonstrated episodes
(played first under a draft tokenizer of the same template); it trains on a pool of fresh additions' demonstrations and
is judged by greedy episodes of the held-out problems (`tiny.tool_play`)."""

from __future__ import annotations

import random

from core.config import ConfigError, TaskConfig, TinyModelConfig
from tiny.arithmetic import fresh_addition
from tiny.network import build_model
from tiny.recipe import Built, Variant
from tiny.recipes import recipe_for
from tiny.tokenizer import CORPUS_PROBLEMS, build_tokenizer
from tiny.warmup import WarmUpPlan, warm_up

# Demonstrated tool episodes a tool warm-up draws from (each played through its environment once, at build).
TOOL_POOL = 4096
# The draft tokenizer knows few pieces of the tool format: room for its episodes, which only give the corpus text.
DRAFT_EPISODE_TOKENS = 4096


def tool_plan(tiny: TinyModelConfig, task: TaskConfig, heldout) -> tuple[object, WarmUpPlan]:
    """The tokenizer and warm-up of a tiny model that calls tools (see the module's docstring)."""
    from tiny.tool_play import ToolPlay

    if task.name != "arithmetic":
        raise ConfigError("model.tiny.warmup_tools: the tool warm-up demonstrates additions (task.name: arithmetic)")
    rng, limit, avoid = random.Random(tiny.seed + 11), 10**task.digits, {p.prompt for p in heldout}
    problems = [p for p in (fresh_addition(rng, limit, avoid) for _ in range(TOOL_POOL)) if p is not None]
    draft = build_tokenizer(task.digits, tiny.seed, tools=True)
    demonstrated = ToolPlay(draft, tiny.warmup_tools, task, DRAFT_EPISODE_TOKENS).demonstrations(
        problems[: CORPUS_PROBLEMS // 4]
    )
    texts = [draft.decode(ids) for ids, _ in demonstrated]
    tokenizer = build_tokenizer(task.digits, tiny.seed, texts=texts, tools=True)
    play = ToolPlay(tokenizer, tiny.warmup_tools, task, tiny.max_position_embeddings)
    pool = play.demonstrations(problems)
    return tokenizer, WarmUpPlan(lambda rng: rng.choice(pool), lambda model: play.greedy_accuracy(model, heldout))


def tool_build(model_cfg, task_cfg, log, plain) -> Built:
    """A tiny model built from scratch and warmed up on tool episodes."""
    tiny = model_cfg.tiny
    heldout = recipe_for(task_cfg).data(task_cfg, tiny).heldout
    tokenizer, plan = tool_plan(tiny, task_cfg, heldout)
    model = build_model(tiny, len(tokenizer), tokenizer.eos_token_id, tiny.max_position_embeddings)
    acc, steps = warm_up(model, tokenizer, tiny, plan, log=log)
    return model, tokenizer, {"heldout_accuracy": acc, "warmup_steps": steps}


# A tool template, warmed up on played tool episodes.
TOOLS = Variant(
    "tools",
    ("warmup_tools",),
    lambda tiny: None if tiny.warmup_tools is None else tiny.warmup_tools.model_dump(),
    tool_build,
)
