"""reasoning-gym as a task, with the real library: seeded splits that never share a question, the weighted mix its
composite dataset draws, rewards that are its datasets' own `score_answer`, a scorer that raises costing only its
sample, and config mistakes that name their field."""

import collections
import importlib.metadata
import logging
import sys

import pytest
import reasoning_gym
from reasoning_gym.arithmetic.leg_counting import LegCountingDataset
from reasoning_gym.utils import extract_answer

from app.tasks.checks import check_names
from app.tasks.problems import ANSWER_OPEN, load_task
from app.tasks.rewards import RewardScorer, reasoning_gym_score
from core.config import CONFIG_DIR, ConfigError, load_config

ADDITIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3, "operators": ["+"]}
LEGS = {"min_animals": 1, "max_animals": 2, "max_instances": 3}


def run_config(*overrides: str, num_train: int = 300, num_heldout: int = 60, **datasets: tuple[float, dict]):
    """A run's config of task reasoning_gym over `datasets` ({name: (weight, config)}), as YAML overrides give it."""
    datasets = datasets or {"basic_arithmetic": (2, ADDITIONS), "leg_counting": (1, LEGS)}
    mix = ", ".join(f"{name}: {{weight: {w}, config: {config}}}" for name, (w, config) in datasets.items())
    return load_config(
        None,
        [
            "task.name=reasoning_gym",
            f"task.datasets={{{mix}}}",
            f"task.num_train={num_train}",
            f"task.num_heldout={num_heldout}",
            "task.reward_funcs=[reasoning_gym]",
            *overrides,
        ],
    )


def source(problem) -> str:
    return problem.columns["rg_entry"]["metadata"]["source_dataset"]


def test_splits_are_the_librarys_items_deterministic_by_seed_and_never_share_a_question():
    cfg = run_config()
    splits, again = load_task(cfg.task), load_task(cfg.task)
    assert (len(splits.train), len(splits.heldout)) == (300, 60)
    assert [(p.id, p.prompt, p.answer) for p in splits.train] == [(p.id, p.prompt, p.answer) for p in again.train]
    assert [p.prompt for p in splits.heldout] == [p.prompt for p in again.heldout]
    prompts = [p.prompt for p in splits.train + splits.heldout]
    assert len(set(prompts)) == len(prompts)  # no question twice, in a split or across them

    for problem in splits.train + splits.heldout:
        entry = problem.columns["rg_entry"]
        assert problem.prompt == entry["question"].rstrip() + "\n" + ANSWER_OPEN
        assert problem.answer == entry["answer"] and problem.reference == entry["answer"] + "</answer>"
        assert problem.columns["rg_dataset"].score_answer(problem.answer, entry) == 1.0  # the library's own check
    legs = next(p for p in splits.heldout if source(p) == "leg_counting")
    assert legs.prompt.startswith("Your task is to count how many legs")

    other = load_task(run_config("task.seed=99").task)
    assert {p.prompt for p in other.heldout} != {p.prompt for p in splits.heldout}


def test_a_small_question_space_is_split_apart_or_refused_naming_the_size():
    """One-digit additions have 121 questions: the splits still never share one (the library's seeds alone would
    not promise that), and a train split larger than what is left is a ConfigError, not an endless draw."""
    one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    one_digit |= {"allow_parentheses": False}
    splits = load_task(run_config(num_train=40, num_heldout=40, basic_arithmetic=(1, one_digit)).task)
    assert not {p.prompt for p in splits.train} & {p.prompt for p in splits.heldout}
    with pytest.raises(ConfigError, match=r"task.num_train=400: the datasets gave \d+ distinct questions"):
        load_task(run_config(num_train=400, num_heldout=40, basic_arithmetic=(1, one_digit)).task)


@pytest.mark.parametrize("weights, share", [((3, 1), 0.75), ((1, 3), 0.25)])
def test_the_weighted_mix_is_respected(weights, share):
    big_legs = {"min_animals": 2, "max_animals": 4}  # questions too many to repeat, so none is dropped as seen
    cfg = run_config(num_train=2000, basic_arithmetic=(weights[0], ADDITIONS), leg_counting=(weights[1], big_legs))
    counts = collections.Counter(source(p) for p in load_task(cfg.task).train)
    assert counts["basic_arithmetic"] / 2000 == pytest.approx(share, abs=0.03)


def columns_of(problems, completions_per_problem: int = 1) -> dict:
    """The columns the rollout's sampler gives reward functions: the answer, truncation and the problem's own."""
    rows = [p for p in problems for _ in range(completions_per_problem)]
    return {
        "answer": [p.answer for p in rows],
        "truncated": [False] * len(rows),
        **{key: [p.columns[key] for p in rows] for key in rows[0].columns},
    }


def test_rewards_are_the_datasets_own_score_answer_of_the_answer_the_library_extracts():
    heldout = load_task(run_config().task).heldout
    arithmetic = next(p for p in heldout if source(p) == "basic_arithmetic")
    legs = next(p for p in heldout if source(p) == "leg_counting")
    gold = arithmetic.answer
    completions = [
        f"{gold}</answer>",  # right
        f" {gold} </answer>",  # right, with the spaces the library's extraction strips
        f"{gold}1</answer>",  # contains the answer: the default score_answer gives partial credit
        "0</answer>",  # wrong
        f"{gold}",  # never closed: no answer
        f"{legs.answer}</answer>",
    ]
    problems = [arithmetic] * 5 + [legs]
    columns = columns_of(problems)
    scores = RewardScorer.from_names(["reasoning_gym"]).score(
        completions, [p.prompt for p in problems], [[1]] * 6, columns
    )

    config = {"basic_arithmetic": ADDITIONS, "leg_counting": LEGS}  # each dataset, made afresh by the library
    expected = [
        reasoning_gym.create_dataset(source(p), **config[source(p)]).score_answer(
            extract_answer(ANSWER_OPEN + c), p.columns["rg_entry"]
        )
        for c, p in zip(completions, problems, strict=True)
    ]
    assert scores.rewards == expected
    assert scores.rewards[:2] == [1.0, 1.0] and 0 < scores.rewards[2] < 1 and scores.rewards[5] == 1.0
    assert scores.rewards[4] == 0.0 and scores.errors == {}


def test_a_score_answer_that_raises_scores_its_sample_0_and_is_logged(monkeypatch, caplog):
    heldout = load_task(run_config().task).heldout
    legs = next(p for p in heldout if source(p) == "leg_counting")
    arithmetic = next(p for p in heldout if source(p) == "basic_arithmetic")

    def broken(self, answer, entry):
        raise ZeroDivisionError("no legs")

    monkeypatch.setattr(LegCountingDataset, "score_answer", broken)
    problems = [legs, arithmetic]
    completions = [f"{legs.answer}</answer>", f"{arithmetic.answer}</answer>"]
    with caplog.at_level(logging.WARNING, logger="app.tasks.rewards"):
        scores = reasoning_gym_score(completions, None, None, **columns_of(problems))
    assert scores == [0.0, 1.0]  # the other dataset's sample keeps its score
    assert (
        "reasoning_gym leg_counting: score_answer raised ZeroDivisionError: no legs; 1 samples scored 0" in caplog.text
    )

    malformed = dict(arithmetic.columns["rg_entry"])
    del malformed["answer"]  # the library's default score_answer reads entry["answer"]: a KeyError
    columns = columns_of([arithmetic]) | {"rg_entry": [malformed]}
    assert reasoning_gym_score([f"{arithmetic.answer}</answer>"], None, None, **columns) == [0.0]


def test_the_shipped_config_passes_the_run_sides_checks():
    cfg = load_config(CONFIG_DIR / "tiny-reasoning-gym.yaml")
    check_names(cfg)
    assert list(cfg.task.datasets) == ["basic_arithmetic"] and cfg.task.reward_funcs == ["reasoning_gym"]


@pytest.mark.parametrize(
    "datasets, field",
    [
        ({"nope": (1, {})}, "task.datasets.nope: reasoning-gym has no such dataset"),
        ({"leg_counting": (1, {"legs": 3})}, "task.datasets.leg_counting.config: TypeError"),
        ({"leg_counting": (1, {"min_animals": 0})}, "task.datasets.leg_counting.config: AssertionError"),
        ({"composite": (1, {})}, "task.datasets.composite: the task is already"),
    ],
)
def test_datasets_the_library_refuses_are_config_errors_naming_the_field_at_start(datasets, field):
    cfg = run_config(**datasets)
    for check in (check_names, lambda cfg: load_task(cfg.task)):
        with pytest.raises(ConfigError) as err:
            check(cfg)
        assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_a_run_without_the_package_is_told_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ConfigError, match=r"^task.name: reasoning_gym needs the reasoning-gym package: .*\[tasks\]"):
        load_task(run_config().task)


def test_the_tiny_model_of_a_run_without_the_package_is_refused_in_the_same_line(monkeypatch):
    """`python -m tiny` keys its folder by the library's version before it loads a problem."""
    from tiny.folder import tiny_model_folder

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    cfg = run_config()
    with pytest.raises(ConfigError, match=r"^task.name: reasoning_gym needs the reasoning-gym package: .*\[tasks\]"):
        tiny_model_folder(cfg.model, cfg.task)


def test_a_split_the_datasets_cannot_fill_is_a_config_error_at_start():
    """The check at start draws the splits: a size the datasets cannot fill with distinct questions used to be found
    by the rollout, after Ray and the fleet had started."""
    one_kind = {"min_animals": 1, "max_animals": 1, "max_instances": 3}  # about a hundred distinct questions
    with pytest.raises(ConfigError, match=r"^task\.num_train=200: the datasets gave \d+ distinct questions"):
        check_names(run_config(num_train=200, num_heldout=20, leg_counting=(1, one_kind)))
