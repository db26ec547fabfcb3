"""A tiny model that reads a self teacher's context (`model.tiny.warmup_context`, self-distillation).

A self teacher is the model shown a problem's answer in its prompt; a pretrained model reads it (what SDFT's teacher
relies on), a model this small has never seen one. The build starts from the same config's model without the context
(the embedded default, cached or built first) and goes on with the problems shown under the template, until held-out
accuracy shown so reaches `model.tiny.warmup_context_accuracy`.
"""

from __future__ import annotations

import random

from app.tasks.privileged import privileged_problem
from app.tasks.problems import Problem
from core.config import ConfigError, TaskConfig
from tiny.recipe import Built, Variant, warmed_further
from tiny.recipes import recipe_for
from tiny.warmup import Judge, WarmUpData, WarmUpPlan, encode, greedy_accuracy, reference_example, warm_up


def context_plan(
    tokenizer, template: str, task: TaskConfig, heldout: list[Problem], pool: list[Problem], judge: Judge
) -> WarmUpPlan:
    """The warm-up's second part: the task's problems, each shown under the teacher's template with its answer,
    judged on the held-out problems shown so."""
    recipe = recipe_for(task)
    if not recipe.single_turn:
        raise ConfigError("model.tiny.warmup_context: the warm-up shows a context to single-turn tasks only")
    data = WarmUpData(heldout, [], pool)
    shown = [privileged_problem(template, p) for p in heldout]
    longest = max(len(encode(tokenizer, p.reference)) for p in heldout)

    def example(rng: random.Random) -> tuple[list[int], list[int]] | None:
        problem = recipe.draw(rng, task, data)
        return None if problem is None else reference_example(tokenizer, privileged_problem(template, problem))

    return WarmUpPlan(example, lambda model: greedy_accuracy(model, tokenizer, shown, longest + 1, judge=judge))


def taught_context(model_cfg, task_cfg, log, plain) -> Built:
    """The same config's model without the context (`plain` builds it if it is not cached), warmed up on the problems
    shown under the template; what the build measured holds the student's own accuracy after, shown no answer."""
    tiny = model_cfg.tiny
    model, tokenizer, origin = warmed_further(model_cfg, task_cfg, log, plain, "warmup_context")
    recipe = recipe_for(task_cfg)
    data = recipe.data(task_cfg, tiny)
    with recipe.judge(task_cfg) as judge:
        shown = context_plan(tokenizer, tiny.warmup_context, task_cfg, data.heldout, data.pool, judge)
        shown_acc, steps = warm_up(model, tokenizer, tiny, shown, log=log, target=tiny.warmup_context_accuracy, part=2)
        acc = recipe.plan(tokenizer, tiny, task_cfg, data, judge).accuracy(model)  # shown no answer
    log(f"held-out accuracy {acc:.3f}; shown the answer in context {shown_acc:.3f}")
    return (
        model,
        tokenizer,
        {
            "heldout_accuracy": acc,
            "context_heldout_accuracy": shown_acc,
            "context_warmup_steps": steps,
            **origin,
        },
    )


# Also taught to read a self teacher's context (the key without stays).
CONTEXT = Variant(
    "context",
    ("warmup_context", "warmup_context_accuracy"),
    lambda tiny: None if tiny.warmup_context is None else [tiny.warmup_context, tiny.warmup_context_accuracy],
    taught_context,
)
