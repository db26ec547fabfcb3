"""A tiny model that also judges answers (`model.tiny.warmup_judge`, the tiny judge demo: `configs/tiny-judge.yaml`).

A run's judge (`app.rollout.judges`) shows a model the problem, the sample and, where the template says so, the gold
answer, and reads a verdict from the model's log-probs. A model this small cannot add better than the student it
would judge, so the tiny judge is a reference-guided one: taught to say whether an answer is the gold one, as an
LLM judge given the reference does. The build starts from the same config's model without it (the embedded default,
cached or built first) and goes on with judge prompts, rendered exactly as the run's judge renders them, each followed
by its verdict ("1" right, "0" wrong: one digit token each of the tiny tokenizer), until its verdicts on held-out
problems reach `model.tiny.warmup_judge_accuracy`. The answers shown are the right one or a near miss (a digit
changed, dropped or added, off by one or ten, an empty answer), what a student that is sometimes right writes. Half
of each batch replays the model's own greedy answers to fresh problems, right or wrong, so that the student it also
is stays the one it was (trained on verdicts alone, its held-out accuracy fell from 45% to 0).

The judge is the base model the fleet serves (`model: base`); the student is a LoRA adapter on it, so training the
student never changes its judge.
"""

from __future__ import annotations

import random

import torch

from app.rollout.judges import render
from app.tasks.problems import Problem
from core.config import ConfigError, TaskConfig
from tiny.recipe import Built, Variant, warmed_further
from tiny.recipes import recipe_for
from tiny.warmup import WarmUpData, WarmUpPlan, encode, greedy_completions, warm_up

YES, NO = "1", "0"  # the verdict tokens a tiny judge answers with: a run's logprob verdict names them
NEAR_MISSES_PER_PROBLEM = 3  # wrong answers judged per held-out problem, beside its right one
OWN_ANSWERS = 4096  # fresh problems the model answers before it learns to judge, replayed beside the verdicts
Example = tuple[list[int], list[int]]  # token ids and loss mask


def near_miss(rng: random.Random, answer: str) -> str:
    """A wrong answer close to `answer`: what a student that is sometimes right writes instead."""
    digits = "0123456789"
    for _ in range(32):
        how = rng.randrange(6)
        if how == 0 and answer:  # one digit changed
            i = rng.randrange(len(answer))
            wrong = answer[:i] + rng.choice(digits.replace(answer[i], "")) + answer[i + 1 :]
        elif how == 1 and len(answer) > 1:  # one digit dropped
            i = rng.randrange(len(answer))
            wrong = answer[:i] + answer[i + 1 :]
        elif how == 2:  # one digit added
            i = rng.randrange(len(answer) + 1)
            wrong = answer[:i] + rng.choice(digits) + answer[i:]
        elif how == 3 and answer.isdigit():  # off by one or ten (a carry missed)
            wrong = str(max(0, int(answer) + rng.choice((-10, -1, 1, 10))))
        elif how == 4:  # two digits swapped, or any other short number
            wrong = answer[::-1] if len(answer) > 1 and rng.random() < 0.5 else str(rng.randrange(200))
        else:  # nothing at all
            wrong = ""
        if wrong != answer:
            return wrong
    return answer + "0"


def verdict_example(tokenizer, template: str, problem: Problem, shown: str) -> Example:
    """The judge prompt of `problem` showing answer `shown`, as the run's judge renders it, then its verdict (token
    ids, loss mask: the verdict alone)."""
    text = render(template, problem.prompt, shown, problem.answer, problem.columns)
    verdict = YES if shown == problem.answer else NO
    ids = encode(tokenizer, text) + encode(tokenizer, verdict)
    return ids, [0] * (len(ids) - 1) + [1]


@torch.no_grad()
def verdict_accuracy(model, tokenizer, template: str, problems: list[Problem], seed: int) -> float:
    """Share of judge prompts of `problems` (each with its right answer and near misses) whose likelier verdict
    token is the right one: what a logprob verdict of p(yes) / (p(yes) + p(no)) over 0.5 says."""
    rng = random.Random(seed)
    yes, no = encode(tokenizer, YES)[0], encode(tokenizer, NO)[0]
    shown = [
        (p, a)
        for p in problems
        for a in [p.answer, *(near_miss(rng, p.answer) for _ in range(NEAR_MISSES_PER_PROBLEM))]
    ]
    model.eval()
    right = 0
    for i in range(0, len(shown), 256):
        rows = [verdict_example(tokenizer, template, p, a)[0][:-1] for p, a in shown[i : i + 256]]
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.eos_token_id] * (width - len(r)) for r in rows])
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=attn).logits
        last = logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]
        says_yes = (last[:, yes] > last[:, no]).tolist()
        right += sum(s == (a == p.answer) for s, (p, a) in zip(says_yes, shown[i : i + 256], strict=True))
    model.train()
    return right / len(shown)


def own_answers(model, tokenizer, task: TaskConfig, data: WarmUpData, seed: int) -> list[Example]:
    """The model's own greedy answers to fresh problems of the task (none held out), right or wrong, as examples:
    the prompt, then the answer's ids as the model wrote them (loss on the answer)."""
    recipe = recipe_for(task)
    rng = random.Random(seed)
    drawn = [p for p in (recipe.draw(rng, task, data) for _ in range(OWN_ANSWERS)) if p is not None]
    longest = max(len(encode(tokenizer, p.reference)) for p in data.heldout)
    answered = greedy_completions(model, tokenizer, [p.prompt for p in drawn], longest + 1)
    examples = []
    for problem, (_, ids) in zip(drawn, answered, strict=True):
        prompt = encode(tokenizer, problem.prompt)
        examples.append((prompt + ids, [0] * len(prompt) + [1] * len(ids)))
    return examples


def judge_plan(
    tokenizer, template: str, task: TaskConfig, data: WarmUpData, seed: int, own: list[Example]
) -> WarmUpPlan:
    """The warm-up's second part: fresh problems of the task (none held out), half shown with the right answer and
    half with a near miss, beside as many of the model's `own` answers replayed; judged on the held-out problems."""
    recipe = recipe_for(task)
    if not recipe.single_turn:
        raise ConfigError("model.tiny.warmup_judge: the tiny judge judges single-turn tasks' answers only")

    def example(rng: random.Random) -> Example | None:
        if rng.random() < 0.5:
            return rng.choice(own)
        problem = recipe.draw(rng, task, data)
        if problem is None:
            return None
        shown = problem.answer if rng.random() < 0.5 else near_miss(rng, problem.answer)
        return verdict_example(tokenizer, template, problem, shown)

    return WarmUpPlan(example, lambda model: verdict_accuracy(model, tokenizer, template, data.heldout, seed))


def taught_to_judge(model_cfg, task_cfg, log, plain) -> Built:
    """The same config's model without the judge (`plain` builds it if it is not cached), warmed up on judge prompts;
    what the build measured holds the model's own held-out accuracy after (as a student) and its verdicts'."""
    tiny = model_cfg.tiny
    model, tokenizer, origin = warmed_further(model_cfg, task_cfg, log, plain, "warmup_judge")
    for verdict in (YES, NO):
        if len(encode(tokenizer, verdict)) != 1:
            raise ConfigError(f"model.tiny.warmup_judge: the verdict {verdict!r} is not one token of the tiny model")
    recipe = recipe_for(task_cfg)
    data = recipe.data(task_cfg, tiny)
    own = own_answers(model, tokenizer, task_cfg, data, tiny.seed + 3)
    plan = judge_plan(tokenizer, tiny.warmup_judge, task_cfg, data, tiny.seed, own)
    # Slower than the answers' warm-up: at its 1e-3 the verdicts stalled near the share of wrong answers shown.
    judging = tiny.model_copy(update={"warmup_lr": tiny.warmup_judge_lr})
    judged, steps = warm_up(model, tokenizer, judging, plan, log=log, target=tiny.warmup_judge_accuracy, part=3)
    with recipe.judge(task_cfg) as judge:
        acc = recipe.plan(tokenizer, tiny, task_cfg, data, judge).accuracy(model)  # as a student, shown no answer
    log(f"held-out accuracy {acc:.3f}; verdicts right on held-out answers {judged:.3f}")
    return (
        model,
        tokenizer,
        {
            "heldout_accuracy": acc,
            "judge_heldout_accuracy": judged,
            "judge_warmup_steps": steps,
            **origin,
        },
    )


# Also taught to judge answers against the gold one (the key without stays).
JUDGE = Variant(
    "judge",
    ("warmup_judge", "warmup_judge_accuracy", "warmup_judge_lr"),
    lambda tiny: (
        None if tiny.warmup_judge is None else [tiny.warmup_judge, tiny.warmup_judge_accuracy, tiny.warmup_judge_lr]
    ),
    taught_to_judge,
)
