"""Multi-turn episodes with a scripted fleet: token-exact trajectories, masks, budgets, failing environments."""

import asyncio
import math
import time

import pytest

from app.rollout.episodes import EpisodeRunner
from app.rollout.sampling import SamplingArgs
from app.tasks.environments import Calculator, ChainedArithmetic, Environment, EnvLost, EnvStep, calculate
from app.tasks.problems import Problem
from contracts.rollouts import Choice
from tests.support.scripted_fleet import EOS, ScriptedFleet, encode

PROBLEM = Problem("p", "Compute 12+34. Answer: ", "46", {"chain": [7, 2]})
PROMPT = [101, 102, 103]


def runner(fleet, env=ChainedArithmetic, max_turns=4, max_episode_tokens=200, timeout_s=2.0):
    return EpisodeRunner(
        env, encode, fleet, max_turns=max_turns, max_episode_tokens=max_episode_tokens, timeout_s=timeout_s
    )


def play(r, n=2, problem=PROBLEM, max_completion_length=8):
    return asyncio.run(
        asyncio.wait_for(r.run_group(problem, PROMPT, "policy-v0", n, SamplingArgs(max_completion_length)), 30)
    )


def test_a_solved_chain_is_one_token_exact_sequence_and_the_mask_covers_exactly_the_models_tokens():
    fleet = ScriptedFleet(["46", "53", "55"])
    episodes = play(runner(fleet), n=2)
    # First turn: one request for the whole group; then one per episode and turn, each extending the last.
    assert fleet.calls[0]["n"] == 2 and fleet.calls[0]["prompt"] == PROMPT and fleet.calls[0]["turn"] == 1
    assert sorted(c["turn"] for c in fleet.calls[1:]) == [2, 2, 3, 3]
    assert fleet.requests == 3  # a later turn is one request for every episode still going
    obs1, obs2 = encode(" Add 7. Answer: "), encode(" Add 2. Answer: ")
    turn1, turn2, turn3 = encode("46") + [EOS], encode("53") + [EOS], encode("55") + [EOS]
    for ep in episodes:
        assert ep.completion_ids == turn1 + obs1 + turn2 + obs2 + turn3
        assert ep.completion_mask == [1] * 3 + [0] * len(obs1) + [1] * 3 + [0] * len(obs2) + [1] * 3
        assert ep.solved and ep.turns == 3 and not ep.truncated and not ep.env_error
        assert ep.reward == pytest.approx(1.0) and ep.turn_rewards == pytest.approx([1 / 3] * 3)
        sample = ep.sample()
        assert sample.model_token_ids() == turn1 + turn2 + turn3 and sample.num_turns == 3
        # Observation tokens carry no sampling log-prob; model tokens carry the fleet's, in place.
        assert all(
            math.isnan(lp) for lp, m in zip(sample.sampling_logprobs, sample.completion_mask, strict=True) if not m
        )
    turn3_calls = [c for c in fleet.calls if c["turn"] == 3]
    assert all(c["prompt"] == PROMPT + turn1 + obs1 + turn2 + obs2 for c in turn3_calls)
    # Each model token's log-prob is the one the fleet returned for it: the first turn's came from call 1.
    assert episodes[0].sampling_logprobs[:3] == [-1.0, -1.1, -1.2]


def test_a_wrong_answer_ends_the_episode_with_the_turns_earned():
    episodes = play(runner(ScriptedFleet(["46", "50", "55"])), n=1)
    (ep,) = episodes
    assert ep.turns == 2 and ep.turn_rewards == pytest.approx([1 / 3, 0.0]) and ep.solved is False
    assert not ep.succeeded and ep.reward == pytest.approx(1 / 3)


def test_max_turns_and_the_token_budget_mark_an_episode_truncated():
    (ep,) = play(runner(ScriptedFleet(["46", "53", "55"]), max_turns=2), n=1)
    assert ep.truncated and ep.turns == 2 and ep.solved is None

    # Budget: prompt 3 + turn 3 + observation 16 + 3 = 25 tokens; 24 cuts the second turn after 2 tokens.
    fleet = ScriptedFleet(["46", "53", "55"])
    (ep,) = play(runner(fleet, max_episode_tokens=24), n=1)
    assert ep.truncated and ep.turns == 2 and ep.turn_rewards == pytest.approx([1 / 3, 0.0])
    assert len(PROMPT) + len(ep.completion_ids) == 24
    assert [c["max_tokens"] for c in fleet.calls] == [8, 2]  # never asks for more than the budget leaves

    # An observation that would leave no room for a reply is never appended.
    (ep,) = play(runner(ScriptedFleet(["46", "53"]), max_episode_tokens=20), n=1)
    assert ep.truncated and ep.turns == 1 and len(ep.completion_ids) == 3


class Exploding(Environment):
    def __init__(self, where="step", hang_s=0.0):
        self.where, self.hang_s = where, hang_s

    def reset(self, problem):
        if self.where == "reset":
            raise RuntimeError("no episode today")

    def step(self, text, token_ids):
        if self.hang_s:
            time.sleep(self.hang_s)
        raise ValueError("bad step")


@pytest.mark.parametrize(
    "env, cause",
    [
        (Exploding("reset"), "reset_raised"),
        (Exploding("step"), "step_raised"),
        (Exploding("step", 1.5), "step_timeout"),
    ],
)
def test_an_environment_that_raises_or_hangs_ends_only_its_episode(env, cause):
    made = iter([env, ChainedArithmetic()])
    r = runner(ScriptedFleet(["46", "53", "55"]), env=lambda: next(made), timeout_s=0.5)
    bad, good = play(r, n=2)
    assert bad.env_error and math.isnan(bad.reward) and bad.turns == 1 and not bad.succeeded
    assert math.isnan(bad.sample().reward) and bad.sample().env_error
    assert good.solved and good.reward == pytest.approx(1.0)
    assert r.env_errors == 1 and r.reward_metrics() == {f"env/errors/{cause}": 1.0}


def test_an_environment_names_the_cause_of_its_lost_episode_and_every_environment_is_closed():
    closed = []

    class Named(ChainedArithmetic):
        def step(self, text, token_ids):
            if text.strip() == "53":
                raise EnvLost("server_gone", "the far end went away")
            return super().step(text, token_ids)

        def close(self):
            closed.append(self)

    r = runner(ScriptedFleet(["46", "53", "55"]), env=Named)
    episodes = play(r, n=3)
    assert all(ep.env_error and ep.turns == 2 for ep in episodes)
    assert r.reward_metrics() == {"env/errors/server_gone": 3.0} and r.env_errors == 3
    assert len(closed) == 3 and len(set(map(id, closed))) == 3


def test_environments_are_closed_when_their_group_fails_and_a_close_that_raises_costs_nothing():
    closed = []

    class Closing(ChainedArithmetic):
        def close(self):
            closed.append(self)
            raise OSError("already gone")

    async def broken_fleet(*args, **kwargs):
        raise ConnectionError("the fleet is down")

    with pytest.raises(ConnectionError):
        play(runner(broken_fleet, env=Closing), n=2)
    assert len(closed) == 2
    (ep,) = play(runner(ScriptedFleet(["46", "53", "55"]), env=Closing), n=1)  # a close that raises: still solved
    assert ep.solved and len(closed) == 3


def test_closing_the_runner_closes_a_factory_that_holds_something_for_its_environments():
    """An OpenEnv run's factory holds the client's worker process (`app.tasks.openenv_env.OpenEnvSessions`)."""

    class Holding:
        closed = 0

        def __call__(self):
            return ChainedArithmetic()

        def close(self):
            self.closed += 1

    factory = Holding()
    r = EpisodeRunner(
        factory, encode, ScriptedFleet(["46", "53", "55"]), max_turns=4, max_episode_tokens=200, timeout_s=5.0
    )
    (ep,) = play(r, n=1)
    assert ep.solved and factory.closed == 0  # a group's end closes its environments, not the factory
    r.close()
    assert factory.closed == 1
    EpisodeRunner(
        ChainedArithmetic, encode, ScriptedFleet(["46"]), max_turns=4, max_episode_tokens=200, timeout_s=5.0
    ).close()


def test_environments_that_hang_for_good_cost_later_episodes_nothing():
    """Every environment call of the first groups hangs for good: more hangs than the runner has threads. Later groups,
    whose environments answer, still play to the end instead of timing out in a queue behind the hung calls."""
    import threading

    stuck = threading.Event()

    class Hanging(Environment):
        def reset(self, problem):
            stuck.wait()

        def step(self, text, token_ids):
            return EnvStep(0.0, done=True)

    fleet = ScriptedFleet(["46", "53", "55"])
    r = EpisodeRunner(Hanging, encode, fleet, max_turns=4, max_episode_tokens=200, timeout_s=1.0, max_threads=2)
    try:
        assert all(ep.env_error for ep in play(r, n=3))  # three hung resets, two threads
        r.env_factory = ChainedArithmetic
        (ep,) = play(r, n=1)
        assert ep.solved and not ep.env_error and r.env_errors == 3
    finally:
        stuck.set()
        r.close()


def test_observations_given_as_token_ids_are_used_as_they_are():
    class Ids(Environment):
        def reset(self, problem):
            self.turn = 0

        def step(self, text, token_ids):
            self.turn += 1
            return EnvStep(1.0, done=True) if self.turn == 2 else EnvStep(0.5, observation=[7, 8, 9])

    (ep,) = play(runner(ScriptedFleet(["1", "2"]), env=Ids), n=1)
    assert ep.completion_ids == encode("1") + [EOS, 7, 8, 9] + encode("2") + [EOS]
    assert ep.reward == pytest.approx(1.5) and ep.solved is None and ep.succeeded


@pytest.mark.parametrize(
    "answer", [{"reward": 1}, EnvStep(None, done=True), EnvStep(math.inf, done=True), EnvStep(observation=[1, -2])]
)
def test_an_environment_returning_garbage_is_an_environment_error(answer):
    class Garbage(Environment):
        def reset(self, problem):
            pass

        def step(self, text, token_ids):
            return answer

    r = runner(ScriptedFleet(["1", "2"]), env=Garbage)
    (ep,) = play(r, n=1)
    assert ep.env_error and r.env_errors == 1 and r.reward_metrics() == {"env/errors/step_malformed": 1.0}


def test_a_prompt_longer_than_the_episode_budget_is_refused_before_sampling():
    fleet = ScriptedFleet(["1"])
    with pytest.raises(ValueError, match="no room"):
        play(runner(fleet, max_episode_tokens=3), n=1)
    assert not fleet.calls


def test_calculator_answers_a_call_then_scores_the_final_answer():
    fleet = ScriptedFleet(["calc 12+34", "46"])
    problem = Problem("p", "Compute 12+34. Answer: ", "46")
    (ep,) = play(runner(fleet, env=Calculator), n=1, problem=problem, max_completion_length=16)
    assert ep.completion_ids == encode("calc 12+34") + [EOS] + encode(" = 46. Answer: ") + encode("46") + [EOS]
    assert ep.solved and ep.reward == 1.0 and ep.turns == 2

    (ep,) = play(runner(ScriptedFleet(["47"]), env=Calculator), n=1, problem=problem)
    assert ep.turns == 1 and ep.reward == 0.0 and ep.solved is False


def test_calculator_evaluates_only_bounded_integer_arithmetic():
    assert calculate("12+34*2") == 80 and calculate("(1-3)*4") == -8
    for bad in ("2**100", "__import__('os')", "1/2", "x+1", "9*" * 10 + "9999"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = Calculator(max_calls=1)
    env.reset(Problem("p", "", "4"))
    assert env.step("calc 2**8", []).observation == " = error. Answer: "
    assert env.step("calc 2+2", []).done  # the call budget is spent: this turn is the answer


def test_the_producer_makes_groups_of_episodes_and_counts_environment_errors():
    from app.rollout.producer import GroupProducer
    from app.tasks.problems import make_chained_arithmetic
    from contracts.rollouts import BatchStats
    from core.config import load_config

    problems = make_chained_arithmetic(2, 20, 2, seed=0, extra_operands=(1, 1), operand_max=9).train
    cfg = load_config(
        None, ["env.name=chained_arithmetic", "rollout.max_inflight_tasks=2", "sampling.num_generations=4"]
    )
    calls = iter(range(10**6))

    class FlakyChain(ChainedArithmetic):
        """Fails the step of every fifth episode it plays."""

        def reset(self, problem):
            super().reset(problem)
            self.fails = next(calls) % 5 == 0

        def step(self, text, token_ids):
            if self.fails:
                raise RuntimeError("environment bug")
            return super().step(text, token_ids)

    async def answer_right(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        return [Choice(i, [5, EOS], [-0.5, -0.1], "?", "stop") for i in range(n)]

    async def main():
        episodes = EpisodeRunner(FlakyChain, encode, answer_right, max_turns=3, max_episode_tokens=64, timeout_s=2.0)
        producer = GroupProducer(cfg, problems, lambda p: [1, 2], episodes)
        producer.start()
        batch = await producer.get_groups(5)
        stats = producer.stats()
        await producer.stop()
        return batch, stats

    batch, stats = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(batch.groups) == 5 and all(g.is_episodic and len(g.samples) == 4 for g in batch.groups)
    errored = [s for g in batch.groups for s in g.samples if s.env_error]
    assert errored and all(math.isnan(s.reward) for s in errored)
    assert stats.env_errors_total >= len(errored) and stats.metrics()["env/errors_total"] == stats.env_errors_total
    metrics = BatchStats.of(batch.groups, 0).metrics()
    assert metrics["env/errors"] == len(errored) and metrics["env/turns_mean"] == 1.0
    assert metrics["reward"] == 0.0  # every scored answer was wrong ("?"); the NaN of the failed ones left out
    assert metrics["env/turn_reward/1"] == 0.0 and "env/turn_reward/2" not in metrics


def test_evaluation_with_an_environment_counts_whole_episodes_solved():
    from app.evaluate import evaluate_async

    problems = [Problem("a", "x", "46", {"chain": [7]}), Problem("b", "y", "46", {"chain": [8]})]

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": encode(text)}

    fleet = ScriptedFleet(["46", "53"])  # right for a (46, 53), wrong on b's second turn (54)
    result = asyncio.run(evaluate_async(runner(fleet), Tokenizer(), problems, "policy-v0", 8, 4))
    assert result["accuracy"] == 0.5 and result["mean_reward"] == pytest.approx(0.75) and result["turns_mean"] == 2
    assert all(c["max_tokens"] == 8 for c in fleet.calls)


def test_the_docs_environment_example_plays_as_documented(tmp_path, monkeypatch):
    """The complete example of docs/tasks-and-environments.md, run as a user would name it (`myenvs:Countdown`)."""
    from app.tasks.environments import resolve_environment
    from core.config import load_config
    from tests.support import REPO

    page = (REPO / "docs" / "tasks-and-environments.md").read_text()
    section = page[page.index("## Multi-turn environments") :]
    code = section[section.index("```python") + len("```python") : section.index("```", section.index("```python") + 9)]
    (tmp_path / "myenvs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["env.name=myenvs:Countdown", "env.max_turns=2"])
    countdown = resolve_environment(cfg.env.name)
    (ep,) = play(runner(ScriptedFleet(["46", "45"]), env=countdown), n=1)
    assert ep.solved and ep.reward == 2.0 and ep.turns == 2
    assert ep.completion_ids == encode("46") + [EOS] + encode(" Minus one. Answer: ") + encode("45") + [EOS]


def test_a_group_that_goes_stale_between_turns_is_stopped_and_counted_stale_not_failed(caplog):
    from app.rollout.producer import GroupProducer
    from app.tasks.problems import make_chained_arithmetic
    from core.config import load_config

    problems = make_chained_arithmetic(2, 20, 2, seed=0, extra_operands=(2, 2), operand_max=9).train
    sets = ["env.name=chained_arithmetic", "rollout.max_staleness=1", "rollout.max_inflight_tasks=1"]
    cfg = load_config(None, [*sets, "rollout.staleness_rule=drop_at_take"])  # bound_at_admission: see its own test
    turns_asked = []

    async def learner_moves_on_during_turn_one(
        prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None
    ):
        turns_asked.append(turn)
        if turn == 1 and len(turns_asked) == 1:
            producer.set_policy_version(2)  # two versions ahead of the group's v0 before its second turn
        answer = encode(str(int(problems[0].answer)))  # whatever the problem, the turn continues (right or not)
        prompts = len(prompt_ids) if isinstance(prompt_ids[0], list) else 1
        return [Choice(i, answer + [EOS], [-0.1] * (len(answer) + 1), "x", "stop") for i in range(n * prompts)]

    class AlwaysOn(ChainedArithmetic):
        def step(self, text, token_ids):
            return EnvStep(0.5, observation=" more: ")

    episodes = EpisodeRunner(
        AlwaysOn, encode, learner_moves_on_during_turn_one, max_turns=3, max_episode_tokens=64, timeout_s=2.0
    )
    producer = GroupProducer(cfg, problems, lambda p: [1, 2], episodes)

    async def main():
        producer.start()
        batch = await producer.get_groups(1)
        await producer.stop()
        return batch

    batch = asyncio.run(asyncio.wait_for(main(), 30))
    stats = producer.stats()
    assert batch.groups[0].policy_version == 2 and stats.dropped_stale_total == 1 and stats.dropped_failed_total == 0
    assert turns_asked[:2] == [1, 1]  # the stale group never asked for its second turn: the next group did turn 1
    # The rollout's own logs (a Tinker SDK client an earlier test left in this process may still log its heartbeats).
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("app.") and "failed" in r.getMessage()]


class Judging:
    """A judge's server answering each judge prompt by `verdict(prompt)` ("yes"/"no", or raising: a 500), every
    prompt recorded."""

    def __init__(self, verdict):
        self.verdict, self.prompts = verdict, []

    def handler(self, request):
        import json

        import httpx

        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base-model", "parent": None}]})
        prompts = json.loads(request.content)["prompt"]
        self.prompts += prompts
        try:
            texts = [self.verdict(p) for p in prompts]
        except RuntimeError as e:
            return httpx.Response(500, json={"error": {"message": str(e)}})
        choices = [{"index": i, "text": t, "finish_reason": "stop", "token_ids": []} for i, t in enumerate(texts)]
        return httpx.Response(200, json={"choices": choices})

    def reward(self, **judge):
        """This judge as a reward, its template showing an episode's transcript and its last turn."""
        import httpx

        from app.fleet_client import FleetClient
        from app.rollout.judges import JudgeReward
        from contracts.retry import Backoff
        from core.config.judges import JudgeConfig

        client = FleetClient(
            "http://judge.test", transport=httpx.MockTransport(self.handler), backoff=Backoff(1, 0.0), timeout_s=1.0
        )
        return JudgeReward("j", JudgeConfig(template="{transcript} | {completion}", **judge), client)

    def runner(self, fleet, env, weight=0.5, **judge):
        """An episode runner whose episodes this judge scores too, weighted `weight`."""
        from app.tasks.rewards import RewardScorer
        from tests.support.scripted_fleet import decode

        scorer = RewardScorer([self.reward(**judge)], weights=[weight])
        return EpisodeRunner(
            env, encode, fleet, max_turns=4, max_episode_tokens=200, timeout_s=0.5, decode=decode, judges=scorer
        )


def judged(r, n):
    try:
        return asyncio.run(asyncio.wait_for(r.sample(PROBLEM, PROMPT, "policy-v0", n, SamplingArgs(8)), 120))
    finally:
        r.close()


def test_a_judge_scores_each_played_episode_by_its_transcript_beside_the_environments_reward():
    judge = Judging(lambda prompt: "yes")
    made = iter([Exploding("step"), ChainedArithmetic()])
    r = judge.runner(ScriptedFleet(["46", "53", "55"]), lambda: next(made))
    lost, played = judged(r, 2).samples
    # One request for the group, one prompt per episode played (the one the environment cost has no reward to add to).
    assert judge.prompts == [
        "user: Compute 12+34. Answer: \nassistant: 46\nuser:  Add 7. Answer: \nassistant: 53\n"
        "user:  Add 2. Answer: \nassistant: 55 | 55"
    ]
    assert played.reward == pytest.approx(1.0 + 0.5) and played.turn_rewards == pytest.approx(
        [1 / 3, 1 / 3, 1 / 3 + 0.5]
    )
    assert lost.env_error and math.isnan(lost.reward)
    metrics = r.reward_metrics()
    assert (
        metrics["judge/j/requests"] == 1 and metrics["judge/j/samples"] == 1 and metrics["env/errors/step_raised"] == 1
    )


def test_a_judges_heldout_agreement_reads_each_episode_as_training_judged_it():
    """The held-out measure of a judge's agreement (`app.evaluate.agreements`) shows it an episode as training does:
    its transcript, every turn in order, and its last turn as `{completion}`; never the sample's text (the turns and
    observations run together, as if one assistant turn)."""
    from app.evaluate import agreements

    judge = Judging(lambda prompt: "yes" if prompt.endswith("assistant: 55 | 55") else "no")
    (right,) = judged(judge.runner(ScriptedFleet(["46", "53", "55"]), ChainedArithmetic), 1).samples
    (wrong,) = judged(judge.runner(ScriptedFleet(["46", "53", "50"]), ChainedArithmetic), 1).samples
    trained = list(judge.prompts)
    assert right.text == "46 Add 7. Answer: 53 Add 2. Answer: 55" and right.judged[0] == PROBLEM.prompt
    found = agreements({"j": judge.reward()}, [PROBLEM] * 2, [right, wrong], [True, False])
    assert found == {"j": 1.0} and judge.prompts == trained * 2  # the prompts of training, asked again


def test_a_judge_reads_observations_given_as_token_ids_decoded():
    class Ids(Environment):
        def reset(self, problem):
            self.turn = 0

        def step(self, text, token_ids):
            self.turn += 1
            return EnvStep(1.0, done=True) if self.turn == 2 else EnvStep(0.0, observation=encode(" more"))

    judge = Judging(lambda prompt: "no")
    (sample,) = judged(judge.runner(ScriptedFleet(["1", "2"]), Ids), 1).samples
    assert judge.prompts == ["user: Compute 12+34. Answer: \nassistant: 1\nuser:  more\nassistant: 2 | 2"]
    assert sample.text == "12" and sample.reward == pytest.approx(1.0)  # the sample's text is as before: no observation


def fails(prompt):
    raise RuntimeError("engine died")


@pytest.mark.parametrize(
    ("on_failure", "errors", "reward"), [("fallback", {}, 1.0 + 0.5 * 0.2), ("drop", {"j": 2}, 1.0)]
)
def test_a_judge_that_fails_on_episodes_costs_what_it_costs_a_single_turn_group(on_failure, errors, reward):
    """Its fallback, counted; or, with drop, its samples unscored, named in the group's reward errors, which the
    rollout drops (`app.rollout.producer`)."""
    r = Judging(fails).runner(
        ScriptedFleet(["46", "53", "55"]), ChainedArithmetic, on_failure=on_failure, fallback_score=0.2
    )
    sampled = judged(r, 2)
    assert sampled.reward_errors == errors
    assert [s.reward for s in sampled.samples] == [pytest.approx(reward)] * 2
    assert r.reward_metrics()["judge/j/failed"] == 2
