"""Rewards: TRL's signature, math-verify equivalences, truncation, and failures that never stop a run."""

import time

import pytest

from app.tasks.rewards import RewardScorer, boxed_math, exact_answer, last_boxed, resolve_reward


def test_exact_answer():
    assert exact_answer(["42", " 41", "42 "], None, None, answer=["42", "42", "42"]) == [1.0, 0.0, 1.0]


def test_last_boxed_balances_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_boxed_math_equivalences_and_truncation():
    completions = [r"so \boxed{0.5}", r"\boxed{\frac{1}{3}}", "the answer is 1/2", r"\boxed{\frac12}"]
    scores = boxed_math(completions, None, None, answer=[r"\frac{1}{2}"] * 4, truncated=[False, False, False, True])
    assert scores == [1.0, 0.0, 0.0, 0.0]  # equivalent, wrong, no box, truncated


def test_scorer_sums_functions():
    def bonus(completions, prompts, completion_ids, **_):
        return [0.5] * len(completions)

    scores = RewardScorer([exact_answer, bonus]).score(["1", "2"], ["p", "p"], [[1], [2]], {"answer": ["1", "1"]})
    assert scores.rewards == [1.5, 0.5]
    assert scores.per_func["bonus"] == [0.5, 0.5]


def test_scorer_weighs_functions_and_a_none_contributes_nothing():
    """TRL's `reward_weights`: the weighted sum of each function's scores, a None left out (its `nansum`)."""

    def bonus(completions, prompts, completion_ids, **_):
        return [0.5, None]

    scorer = RewardScorer([exact_answer, bonus], weights=[2.0, -1.0])
    scores = scorer.score(["1", "2"], ["p", "p"], [[1], [2]], {"answer": ["1", "1"]})
    assert scores.rewards == [2.0 - 0.5, 0.0]  # the second: exact_answer's 0 times 2, bonus's None nothing
    assert scores.per_func == {"exact_answer": [1.0, 0.0], "bonus": [0.5, None]}  # unweighted, as TRL logs them
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardScorer([exact_answer], weights=[1.0, 1.0])


def test_a_tasks_weights_reach_its_scorer():
    from core.config import load_config

    task = load_config(None, ["task.reward_funcs=[exact_answer, exact_answer]", "task.reward_weights=[0.5, 0.25]"]).task
    scorer = RewardScorer.from_names(task.reward_funcs, weights=task.weights())
    assert scorer.score(["1"], ["p"], [[1]], {"answer": ["1"]}).rewards == [0.75]
    assert load_config(None, []).task.weights() == [1.0]  # unset: 1.0 each


def test_raising_and_slow_rewards_give_none_and_are_counted():
    def broken(completions, prompts, completion_ids, **_):
        raise ZeroDivisionError("boom")

    def slow(completions, prompts, completion_ids, **_):
        time.sleep(2)
        return [1.0] * len(completions)

    def wrong_length(completions, prompts, completion_ids, **_):
        return [1.0]

    scorer = RewardScorer([exact_answer, broken, slow, wrong_length], timeout_s=0.5)
    scores = scorer.score(["1", "2", "3"], ["p"] * 3, [[1]] * 3, {"answer": ["1", "1", "1"]})
    assert scores.rewards == [1.0, 0.0, 0.0]  # only exact_answer counted
    assert scores.per_func["broken"] == [None] * 3 and scores.per_func["slow"] == [None] * 3
    assert scores.errors == {"broken": 3, "slow": 3, "wrong_length": 3}
    scorer.score(["1"], ["p"], [[1]], {"answer": ["1"]})
    assert scorer.metrics()["reward/errors/broken"] == 4.0


def test_resolve_reward():
    assert resolve_reward("exact_answer") is exact_answer
    assert resolve_reward("app.tasks.rewards:boxed_math") is boxed_math
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward("app.tasks.rewards:nope")


def test_rewards_that_hung_cost_no_later_call_its_thread_and_a_timeout_counts_only_the_run():
    """A reward function that hangs for good on some inputs: the scorer's two threads used to be lost to the first
    two, and every later call timed out, also those that would have returned at once; and a timeout counted the
    time a call waited for a thread, so a burst of quick calls timed out in the queue."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stuck = threading.Event()  # never set while the test needs it: a hang for good

    def flaky(completions, prompts, completion_ids, **_):
        if completions[0] == "hang":
            stuck.wait()
        else:
            time.sleep(0.1)
        return [1.0] * len(completions)

    scorer = RewardScorer([flaky], timeout_s=1.0)
    try:
        for _ in range(3):  # more hangs than the scorer has threads
            assert scorer.score(["hang"], ["p"], [[1]], {"answer": ["1"]}).errors == {"flaky": 1}
        assert scorer.score(["ok"], ["p"], [[1]], {"answer": ["1"]}).rewards == [1.0]
        # 26 quick calls at once on its two threads: the last starts 1.2 s after it was asked for, beyond the timeout,
        # and runs 0.1 s, far within it.
        with ThreadPoolExecutor(26) as burst:
            scored = list(burst.map(lambda _: scorer.score(["ok"], ["p"], [[1]], {"answer": ["1"]}), range(26)))
        assert [s.rewards for s in scored] == [[1.0]] * 26
    finally:
        stuck.set()
        scorer.close()


RACE = """
import threading
from concurrent.futures import ThreadPoolExecutor
from app.tasks.rewards import trainer_state
start = threading.Barrier(8)
def first_call(step):
    start.wait()
    return trainer_state(step, 10).global_step
with ThreadPoolExecutor(8) as pool:
    futures = [pool.submit(first_call, step) for step in range(8)]
print(sum(f.exception() is not None for f in futures))
"""


def test_reward_threads_that_first_need_trainer_state_at_once_all_get_it():
    """TRL's rewards get `trainer_state`; in a process that has not imported transformers' trainer yet, the scorer's
    threads import it at once, which its lazy module fails in all but one (two fresh processes: the race does not
    always show)."""
    import subprocess
    import sys

    from core.config import REPO_ROOT

    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", RACE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "0", out.stdout
