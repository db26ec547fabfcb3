"""The reward recipe (`examples/reward_partial_credit.py`): its function scored as a run scores it (by name, through
`RewardScorer`, beside exact_answer), and its command line a config the driver accepts."""

import pytest

from app.tasks.checks import check_names
from app.tasks.rewards import RewardScorer
from core.config import load_config
from examples.reward_partial_credit import Config, close_answer, parse, train_args

NAME = "examples.reward_partial_credit:close_answer"


def test_close_answers_earn_partial_credit_and_the_scorer_sums_it_with_exact_match():
    scorer = RewardScorer.from_names(["exact_answer", NAME])
    completions = ["46", "47", "44 or so", "90", "no idea", ""]
    scores = scorer.score(completions, ["Compute 12+34. Answer: "] * 6, [[1]] * 6, {"answer": ["46"] * 6})
    assert scores.per_func["close_answer"] == pytest.approx([0.5, 0.4, 0.3, 0.0, None, None])
    assert scores.rewards == pytest.approx([1.5, 0.4, 0.3, 0.0, 0.0, 0.0])  # None adds nothing, as in TRL
    assert not scores.errors and scorer.metrics()["reward/logged/parsed_share"] == pytest.approx(4 / 6)


def test_it_takes_trls_chat_completions_and_any_keyword_order():
    chat = [[{"role": "assistant", "content": "45"}]]
    assert close_answer(answer=["46"], completions=chat, prompts=None, trainer_state=None) == [0.4]


def test_its_command_line_is_a_run_the_driver_accepts():
    args = train_args(parse(["steps=3", "run_name=pc", "sets=[sampling.num_generations=4]"]))
    sets = [a for a, flag in zip(args[1:], args, strict=False) if flag == "--set"]
    cfg = load_config(args[1], sets)
    check_names(cfg)  # what the driver checks at start, before Ray
    assert cfg.task.reward_funcs == ["exact_answer", NAME] and cfg.train.max_steps == 3
    assert cfg.sampling.num_generations == 4 and cfg.logging.run_name == "pc"
    assert load_config(args[1], [*sets, "task.reward_funcs=[x]"]).task.reward_funcs == ["x"]  # the user's wins
    with pytest.raises(SystemExit, match="key=value"):
        parse(["steps"])
    assert Config().steps == 20
