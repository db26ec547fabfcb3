"""The environment recipe (`examples/env_second_chance.py`): episodes played by spotrl's episode runner over a
scripted fleet (token-exact, the retry's observation as context), and its command line a config the driver
accepts with the class resolved by name."""

import asyncio

import pytest

from app.kinds.registry import kind_of
from app.rollout.episodes import EpisodeRunner
from app.rollout.sampling import SamplingArgs
from app.tasks.checks import check_names
from app.tasks.environments import resolve_environment
from app.tasks.problems import Problem
from core.config import load_config
from examples.env_second_chance import RETRY, SecondChance, parse, train_args
from tests.support.scripted_fleet import EOS, ScriptedFleet, encode

PROBLEM = Problem("p", "Compute 12+34. Answer: ", "46")


def play(turns, attempts=2, decay=0.5):
    runner = EpisodeRunner(
        lambda: SecondChance(attempts, decay), encode, ScriptedFleet(turns), max_turns=attempts,
        max_episode_tokens=200, timeout_s=2.0,
    )  # fmt: skip
    (episode,) = asyncio.run(runner.run_group(PROBLEM, [101, 102], "policy-v0", 1, SamplingArgs(8)))
    return episode


def test_a_right_first_answer_earns_full_credit_in_one_turn():
    episode = play(["46"])
    assert episode.turns == 1 and episode.reward == 1.0 and episode.solved


def test_a_wrong_answer_gets_another_try_for_less_credit_and_the_retry_is_context():
    episode = play(["45", "46"])
    assert episode.turns == 2 and episode.reward == pytest.approx(0.5) and episode.solved
    first, retry, second = encode("45") + [EOS], encode(RETRY), encode("46") + [EOS]
    assert episode.completion_ids == first + retry + second
    assert episode.completion_mask == [1] * len(first) + [0] * len(retry) + [1] * len(second)


def test_out_of_attempts_the_episode_ends_unsolved():
    episode = play(["1", "2", "3"], attempts=3, decay=0.9)
    assert episode.turns == 3 and episode.reward == 0.0 and episode.solved is False


def test_its_command_line_is_a_run_the_driver_accepts():
    args = train_args(parse(["steps=2", "attempts=3", "decay=0.25"]))
    cfg = load_config(args[1], [a for a, flag in zip(args[1:], args, strict=False) if flag == "--set"])
    check_names(cfg)
    assert kind_of(cfg).field == "name" and resolve_environment(cfg.env.name) is SecondChance
    assert cfg.env.kwargs == {"attempts": 3, "decay": 0.25} and cfg.env.max_turns == 3
