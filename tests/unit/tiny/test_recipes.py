"""The tiny model's build, generalised to tasks with reference answers (reasoning-gym's datasets): its tokenizer learns
their text, its warm-up trains on their reference completions laid out as the rollout lays them out and is judged by
the task's rewards, a context too short for them is refused naming the field, and each task's folder is keyed by
what it depends on (the arithmetic one as before, so the models already built stay in use)."""

import pytest

from app.tasks.problems import SEED_BLOCK, WARMUP_BLOCK, draw_reasoning_gym, load_task
from app.tasks.rewards import RewardScorer
from core.chat_templates import EOS
from core.config import CONFIG_DIR, ConfigError, ModelConfig, TinyModelConfig, load_config
from core.models import prompt_token_ids
from tiny.folder import tiny_model_folder
from tiny.network import build_model
from tiny.recipes import warmup_plan
from tiny.tokenizer import build_tokenizer
from tiny.warmup import WarmUpPlan, check_context, greedy_accuracy, reference_example, rewarded, warm_up

TINY = TinyModelConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    warmup_batch_size=8,
    warmup_max_steps=5,
)


# The shipped config's dataset and a second one: a weighted mix, as a user would make one.
LEGS = "task.datasets.leg_counting={weight: 1, config: {min_animals: 1, max_animals: 2, max_instances: 3}}"


@pytest.fixture(scope="module")
def task():
    cfg = load_config(
        CONFIG_DIR / "tiny-reasoning-gym.yaml",
        ["task.num_train=200", "task.num_heldout=16", "model.tiny.seed=3", LEGS],
    )
    return cfg.task


@pytest.fixture(scope="module")
def splits(task):
    return load_task(task)


@pytest.fixture(scope="module")
def pool(task, splits):
    avoid = frozenset(p.prompt for p in splits.heldout)
    return draw_reasoning_gym(task, 3 + WARMUP_BLOCK * SEED_BLOCK, 300, "warmup", avoid)


@pytest.fixture(scope="module")
def tokenizer(pool):
    return build_tokenizer(2, 0, texts=[p.prompt + p.reference for p in pool])


def test_the_warm_up_pool_is_the_datasets_own_problems_and_holds_no_held_out_one(splits, pool):
    assert len(pool) == 300 and all(p.id.startswith("warmup-") for p in pool)
    assert not {p.prompt for p in pool} & {p.prompt for p in splits.heldout}
    assert {p.columns["rg_entry"]["metadata"]["source_dataset"] for p in pool} == {"basic_arithmetic", "leg_counting"}


def test_the_tokenizer_learns_its_pieces_from_the_tasks_text(tokenizer, splits):
    additions = build_tokenizer(2, 0)  # the arithmetic tokenizer, trained on generated additions
    for problem in splits.heldout:
        text = problem.prompt + problem.reference
        assert len(tokenizer(text)["input_ids"]) < len(additions(text)["input_ids"])
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_a_reference_example_is_the_prompt_as_the_rollout_tokenises_it_then_the_completion_and_eos(tokenizer, splits):
    problem = splits.heldout[0]
    ids, mask = reference_example(tokenizer, problem)
    prompt_ids = prompt_token_ids(tokenizer, problem.prompt)
    assert ids[: len(prompt_ids)] == prompt_ids
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    assert tokenizer.decode(ids[len(prompt_ids) :]) == problem.reference + EOS


def test_greedy_completions_are_judged_by_the_tasks_rewards(tokenizer, splits):
    problems = splits.heldout[:4]
    scorer = RewardScorer.from_names(["reasoning_gym"])
    try:
        judge = rewarded(scorer)
        right = [p.reference for p in problems]
        assert judge(right, problems, [[1]] * 4, [False] * 4) == [True] * 4
        assert judge(["x</answer>"] * 4, problems, [[1]] * 4, [False] * 4) == [False] * 4
        assert judge([p.answer for p in problems], problems, [[1]] * 4, [True] * 4) == [False] * 4  # never closed
    finally:
        scorer.close()

    model = build_model(TINY, len(tokenizer), tokenizer.eos_token_id, TINY.max_position_embeddings)
    seen = []

    def every_one(texts, problems, completion_ids, truncated):
        seen.append((texts, completion_ids, truncated))
        return [True] * len(texts)

    assert greedy_accuracy(model, tokenizer, problems, max_new_tokens=3, judge=every_one) == 1.0
    (texts, completion_ids, truncated) = seen[0]
    eos = tokenizer.eos_token_id
    for text, ids, cut in zip(texts, completion_ids, truncated, strict=True):
        assert cut == (eos not in ids) and (cut or ids[-1] == eos) and len(ids) <= 3
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_warm_up_trains_on_the_pool_and_stops_once_the_judge_says_the_target_is_crossed(
    task, tokenizer, splits, pool
):
    drawn = []

    def accept_all(texts, problems, completion_ids, truncated):
        return [True] * len(texts)

    plan = warmup_plan(tokenizer, TINY, task, splits.heldout, pool, accept_all)
    drawing = WarmUpPlan(lambda rng: drawn.append(plan.example(rng)) or drawn[-1], plan.accuracy)
    model = build_model(TINY, len(tokenizer), tokenizer.eos_token_id, TINY.max_position_embeddings)
    accuracy, steps = warm_up(model, tokenizer, TINY, drawing, log=lambda m: None)
    assert (accuracy, steps) == (1.0, 5)  # judged at step 5, the first judgement: target crossed
    assert len(drawn) == 5 * TINY.warmup_batch_size
    references = {tuple(reference_example(tokenizer, p)[0]) for p in pool}
    assert all(tuple(ids) in references for ids, _ in drawn)

    never = warmup_plan(tokenizer, TINY, task, splits.heldout, pool, lambda texts, *_: [False] * len(texts))
    said = []
    assert warm_up(model, tokenizer, TINY, never, log=said.append) == (0.0, TINY.warmup_max_steps)
    # A warm-up that stops short of its target says so, once: it used to end at the cap without a word.
    short = [line for line in said if "below its target" in line]
    assert short == [
        f"warm-up ended below its target: held-out accuracy 0.000 < {TINY.warmup_target_accuracy:.3f} after "
        f"model.tiny.warmup_max_steps={TINY.warmup_max_steps} steps"
    ]


def test_a_context_too_short_for_the_tasks_problems_names_the_field(tokenizer, splits):
    with pytest.raises(ConfigError, match=r"^model.max_model_len=16: the task's longest problem takes \d+ tokens"):
        check_context(tokenizer, ModelConfig(max_model_len=16), splits.heldout)
    check_context(tokenizer, ModelConfig(max_model_len=96), splits.heldout)


def test_each_tasks_tiny_model_is_keyed_by_what_it_depends_on():
    tiny = load_config(CONFIG_DIR / "tiny-cpu.yaml")
    # The arithmetic default's folder as it was named before reasoning-gym: the models already built stay in use.
    assert tiny_model_folder(tiny.model, tiny.task).name == "tiny-qwen2-50ba3e926688a80c"

    rg = load_config(CONFIG_DIR / "tiny-reasoning-gym.yaml", [LEGS])
    key = tiny_model_folder(rg.model, rg.task)
    assert key != tiny_model_folder(tiny.model, tiny.task)
    assert tiny_model_folder(rg.model, rg.task.model_copy(update={"num_train": 100})) == key  # train: not in the build
    reordered = dict(reversed(list(rg.task.datasets.items())))  # the mix's order seeds each dataset
    for changed in ({"datasets": reordered}, {"reward_funcs": ["exact_answer"]}, {"num_heldout": 128}):
        assert tiny_model_folder(rg.model, rg.task.model_copy(update=changed)) != key, changed


def test_the_context_part_of_the_warm_up_shows_the_answer_under_the_teachers_template():
    import random

    from app.tasks.privileged import privileged_problem
    from app.tasks.problems import make_arithmetic
    from tiny.context import context_plan
    from tiny.warmup import exactly_the_answer

    cfg = load_config(CONFIG_DIR / "tiny-self-distill.yaml")
    template = cfg.model.tiny.warmup_context
    assert template == cfg.teacher.context  # the model learns to read what its self teacher is shown
    arithmetic = build_tokenizer(2, 0)
    heldout = make_arithmetic(2, 1, 8, 0).heldout
    plan = context_plan(arithmetic, template, cfg.task, heldout, [], exactly_the_answer)
    rng = random.Random(0)
    ids, mask = next(e for e in iter(lambda: plan.example(rng), 0) if e is not None)
    text = arithmetic.decode(ids)
    assert text.startswith("Hint: ") and "\nCompute " in text and text.endswith("<|endoftext|>")
    answer = arithmetic.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True)
    assert text.startswith(f"Hint: {answer}\n")  # the loss is on the answer the template showed
    assert privileged_problem(template, heldout[0]).prompt.startswith(f"Hint: {heldout[0].answer}\n")
    chained = cfg.task.model_copy(update={"name": "chained_arithmetic"})
    with pytest.raises(ConfigError, match="single-turn tasks only"):
        context_plan(arithmetic, template, chained, heldout, [], exactly_the_answer)


def test_a_chat_warm_up_sees_an_addition_as_verifiers_renderer_sends_it():
    import random

    from renderers import create_renderer

    from tiny.arithmetic import addition_example, chat_rendered, fresh_addition

    tokenizer = build_tokenizer(2, 0)
    plain = fresh_addition(random.Random(3), 100, set())
    ids, mask = addition_example(tokenizer, random.Random(3), 100, set(), chat_rendered(tokenizer))
    prompt, completion = ids[: mask.index(1)], ids[mask.index(1) :]
    messages = [{"role": "user", "content": plain.prompt}]
    assert prompt == prompt_token_ids(tokenizer, messages)
    assert prompt == create_renderer(tokenizer, None).render(messages, add_generation_prompt=True).token_ids
    assert tokenizer.decode(completion) == plain.answer + EOS
    cfg = load_config(None, ["model.tiny.warmup_chat=true"])
    assert tiny_model_folder(cfg.model, cfg.task) != tiny_model_folder(load_config(None, []).model, cfg.task)


def test_every_task_has_a_recipe():
    from typing import get_args

    from core.config import TaskConfig
    from tiny.recipes import RECIPES

    assert set(RECIPES) == set(get_args(TaskConfig.model_fields["name"].annotation))
