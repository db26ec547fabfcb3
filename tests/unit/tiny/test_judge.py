"""The tiny judge's warm-up (`tiny.judge`): the judge prompts are the run's judge's own rendering with the right
answer or a near miss, followed by the verdict the loss is on; the model's own answers are replayed beside them; the
shipped demo's judge and warm-up share one template; a template that hides the gold answer is refused."""

import random

import pytest
from pydantic import ValidationError

from app.rollout.judges import render
from app.tasks.problems import make_arithmetic
from core.config import CONFIG_DIR, TinyModelConfig, load_config
from tiny.judge import NO, YES, judge_plan, near_miss, verdict_example
from tiny.tokenizer import build_tokenizer
from tiny.warmup import WarmUpData

TEMPLATE = "{completion} vs {reference}? "


def test_a_near_miss_is_never_the_answer():
    rng = random.Random(0)
    for answer in ("0", "7", "42", "100", "198"):
        misses = {near_miss(rng, answer) for _ in range(200)}
        assert answer not in misses and len(misses) > 5, (answer, misses)


def test_a_verdict_example_is_the_runs_judge_prompt_then_its_verdict_the_loss_on_it_alone():
    tokenizer = build_tokenizer(2, 0)
    problem = make_arithmetic(2, 1, 4, 0).heldout[0]
    for shown, verdict in ((problem.answer, YES), (near_miss(random.Random(1), problem.answer), NO)):
        ids, mask = verdict_example(tokenizer, TEMPLATE, problem, shown)
        rendered = render(TEMPLATE, problem.prompt, shown, problem.answer, problem.columns)
        assert tokenizer.decode(ids) == rendered + verdict
        assert mask == [0] * (len(ids) - 1) + [1]


def test_the_judges_warm_up_replays_the_models_own_answers_beside_verdicts_and_holds_out_the_heldout_split():
    tokenizer = build_tokenizer(2, 0)
    cfg = load_config(CONFIG_DIR / "tiny-judge.yaml")
    splits = make_arithmetic(2, 1, 16, 0)
    own = [([1, 2, 3], [0, 0, 1])]
    shown = "{prompt}" + TEMPLATE  # the problem shown too: none of the held-out split may be
    plan = judge_plan(tokenizer, shown, cfg.task, WarmUpData(splits.heldout, splits.train), 0, own)
    rng = random.Random(0)
    examples = [e for e in (plan.example(rng) for _ in range(400)) if e is not None]
    replayed = [e for e in examples if e == own[0]]
    judged = [tokenizer.decode(ids) for ids, _ in examples if (ids, _) != own[0]]
    assert 120 < len(replayed) < 280 and len(judged) > 120
    verdicts = [text[-1] for text in judged]
    assert 0.3 < verdicts.count(YES) / len(verdicts) < 0.7
    assert not any(text.startswith(p.prompt) for p in splits.heldout for text in judged)


def test_the_demos_judge_reads_the_template_its_model_learned_and_a_template_hiding_the_gold_is_refused():
    cfg = load_config(CONFIG_DIR / "tiny-judge.yaml")
    judge = cfg.judges["correct"]
    assert judge.template == cfg.model.tiny.warmup_judge and judge.model == "base"
    assert (judge.verdict.yes_token, judge.verdict.no_token) == (YES, NO)
    assert cfg.task.reward_funcs == ["correct"] and cfg.eval.reward_funcs == ["exact_answer"]
    with pytest.raises(ValidationError, match="gold one"):
        TinyModelConfig(warmup_judge="{completion} right? ")
