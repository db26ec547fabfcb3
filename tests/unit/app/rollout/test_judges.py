"""Judges as rewards (`app.rollout.judges`): the template and its check at start, reading verdicts, one request per
group, what a failing judge costs (its fallback, counted), and the fleet's refusal of another run's adapter; an
episode's transcript, and which kinds of environment a judge may score."""

import json
import math
import re
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from app.fleet_client import FleetClient, FleetError
from app.rollout.judge_probe import JudgeRefused, probe_judges
from app.rollout.judges import (
    FAILED_TOTAL,
    JudgeReward,
    check_template,
    logprob_score,
    parse_generative,
    render,
    transcript,
)
from app.tasks.checks import check_names
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, exact_answer
from contracts.retry import Backoff
from core.config import ConfigError, load_config
from core.config.judges import GenerativeVerdict, JudgeConfig
from deployments.api import make_app
from tests.support.fake_fleet import BASE, FakeBackend, api_settings, register
from tests.support.served_app import answering

TEMPLATE = "Q: {prompt} A: {completion} Gold: {reference}. Right?"


def problem(pid="p1", answer="5", **columns):
    return Problem(pid, "2+3=", answer, columns)


def test_a_template_shows_the_problem_the_completion_and_the_reference():
    assert render(TEMPLATE, "2+3=", " 5", "5", {}) == "Q: 2+3= A:  5 Gold: 5. Right?"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}]
    completion = [{"role": "assistant", "content": "5"}]
    assert render("{prompt}|{completion}|{level}", chat, completion, "5", {"level": 2}) == "2+3=|5|2"


def test_a_transcript_is_every_turn_in_order_and_a_single_turn_one_the_prompt_then_the_completion():
    assert transcript("2+3=", " 5") == "user: 2+3=\nassistant:  5"
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Compute 1+2."}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    episode = [
        {"role": "assistant", "content": "", "tool_calls": [call]},  # a turn that only calls a tool shows the call
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is "}, {"type": "text", "text": "3"}]},
    ]
    shown = render("{transcript}\nlast: {completion}", prompt, episode, "3", {})
    assert shown == (
        'system: be brief\nuser: Compute 1+2.\nassistant: add({"a": 1, "b": 2})\ntool: 3\nassistant: It is 3\n'
        "last: It is 3"
    )
    # An episode of spotrl's own environments: the model's turns, the environment's observations as the user's.
    turns = [
        {"role": "assistant", "content": "46"},
        {"role": "user", "content": " Add 7."},
        {"role": "assistant", "content": "53"},
    ]
    assert render("{transcript} ({completion})", "Compute 12+34.", turns, "53", {}) == (
        "user: Compute 12+34.\nassistant: 46\nuser:  Add 7.\nassistant: 53 (53)"
    )


def test_a_template_shows_the_sample_by_its_completion_or_its_transcript():
    assert JudgeConfig(template="{transcript} ok?").template == "{transcript} ok?"
    with pytest.raises(ValueError, match=r"must show the judge the sample it judges \({completion} or {transcript}\)"):
        JudgeConfig(template="{prompt} ok?")


def test_a_template_naming_a_field_the_problems_lack_is_refused_naming_it():
    check_template("j", TEMPLATE + " {level}", [problem(level=1)])
    with pytest.raises(ValueError, match=r"judges.j.template names colour, which problem 'p2' .* \(it has: "):
        check_template("j", "{completion} {colour}", [problem(colour="red"), problem("p2")])
    with pytest.raises(ValueError, match="judges.j.template names reference; problem 'p1' has no answer"):
        check_template("j", "{completion} {reference}", [problem(answer="")])


def test_a_run_is_refused_at_start_for_an_unknown_field_or_judge():
    judged = ["judges={j: {template: '{completion} {colour}'}}", "task.reward_funcs=[j]"]
    with pytest.raises(ConfigError, match=r"judges.j.template names colour, which problem .* does not have"):
        check_names(load_config(None, judged))
    with pytest.raises(ConfigError, match=r"task.reward_funcs\[1\]: unknown reward function 'jj'.* or a judge .*\(j\)"):
        check_names(load_config(None, [judged[0], "task.reward_funcs=[exact_answer, jj]"]))
    with pytest.raises(ConfigError, match="judges.exact_answer: the name of a registered reward function"):
        check_names(load_config(None, ["judges={exact_answer: {template: '{completion}'}}"]))
    check_names(load_config(None, ["judges={j: {template: '{prompt} {completion} {reference}'}}", judged[1]]))


def test_an_environment_run_may_name_a_judge_of_its_episodes_and_a_kind_no_judge_sees_is_refused_naming_it():
    from app.kinds import registry
    from app.tasks.checks import check_judges
    from core.config import RunConfig

    judged = ["judges={j: {template: '{transcript} {reference}'}}", "task.reward_funcs=[j]"]
    check_names(load_config(None, [*judged, "env.name=calculator"]))
    check_names(
        load_config(None, [*judged, "task.reward_funcs=[exact_answer]", "eval.reward_funcs=[j]", "env.name=calculator"])
    )
    with pytest.raises(ConfigError, match=r"judges.j.template names colour, which problem"):
        check_names(
            load_config(None, ["judges={j: {template: '{transcript} {colour}'}}", judged[1], "env.name=calculator"])
        )
    verifiers = {"verifiers": {"taskset": "examples.verifiers_arithmetic:ArithmeticTaskset"}}
    verifiers = RunConfig.model_validate(load_config(None, judged).model_dump() | {"env": verifiers})
    with pytest.raises(ConfigError) as refused:
        check_judges(verifiers)
    (line,) = str(refused.value).splitlines()
    assert "judge 'j' is named in task.reward_funcs" in line and "episodes of env.verifiers: verifiers plays" in line
    assert all(
        kind.unjudged is None for field, kind in registry.KINDS.items() if field in (None, "name", "openenv", "factory")
    )


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("judges={j: {template: '{completion} {colour}'}}", "judges.j.template names colour"),
        ("task.reward_funcs=[nope]", "task.reward_funcs[0]: unknown reward function 'nope'"),
    ],
)
def test_the_train_cli_says_so_in_one_line(override, needle):
    args = ["--set", override] + (["--set", "task.reward_funcs=[j]"] if override.startswith("judges") else [])
    proc = subprocess.run([sys.executable, "-m", "launch.train", *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("text", "verdict", "score"),
    [
        (" Yes, it is.", {}, 1.0),
        ("no", {}, 0.0),
        ("\n NO.", {}, 0.0),
        ("Maybe yes", {}, None),
        ("", {}, None),
        ("score=3 then score=7", {"parse": "regex", "pattern": r"score=(\d+)"}, 7.0),
        ("score=0.25", {"parse": "regex", "pattern": r"score=([\d.]+)"}, 0.25),
        ("score=..", {"parse": "regex", "pattern": r"score=([\d.]+)"}, None),
        ("nothing", {"parse": "regex", "pattern": r"score=(\d+)"}, None),
        ("score=nan", {"parse": "regex", "pattern": r"score=(\w+)"}, None),
    ],
)
def test_a_generated_verdict_reads_as_a_score_or_as_unreadable(text, verdict, score):
    assert parse_generative(text, GenerativeVerdict(**verdict)) == score


def test_a_logprob_verdict_is_the_share_of_yes():
    assert logprob_score(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert logprob_score(math.log(0.3), None) == pytest.approx(0.3)
    assert logprob_score(-math.inf, math.log(0.1)) == 0.0
    with pytest.raises(ValueError, match="ruled out both"):
        logprob_score(-math.inf, -math.inf)
    with pytest.raises(ValueError, match="no log-prob"):
        logprob_score(math.nan, 0.0)


class Tokens:
    """A tokenizer of one id per character, as `prompt_token_ids` calls one."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class Judge:
    """A judge server: each request recorded; `answer(body)` says what it answers, or raises."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base-model", "parent": None}]})
        body = json.loads(request.content)
        self.requests.append(body)
        return self.answer(body)

    def reward(self, name="j", tokenizer=None, **judge) -> JudgeReward:
        client = FleetClient(
            "http://judge.test", transport=httpx.MockTransport(self.handler), backoff=Backoff(1, 0.0), timeout_s=1.0
        )
        return JudgeReward(name, JudgeConfig(template=TEMPLATE, **judge), client, tokenizer)


def texts(*answers):
    choices = [{"index": i, "text": t, "finish_reason": "stop", "token_ids": []} for i, t in enumerate(answers)]
    return lambda body: httpx.Response(200, json={"choices": choices[: len(body["prompt"])]})


def score(judge: JudgeReward, completions, scorer_funcs=()):
    """The judge scored as the rollout scores it: by a `RewardScorer`, with TRL's keywords."""
    scorer = RewardScorer([*scorer_funcs, judge], timeout_s=10.0)
    n = len(completions)
    columns = {"answer": ["5"] * n, "truncated": [False] * n, "level": [1] * n}
    try:
        return scorer.score(completions, ["2+3="] * n, [[1]] * n, columns), scorer.metrics()
    finally:
        scorer.close()


def test_a_group_is_judged_in_one_request_and_an_unreadable_verdict_counted():
    server = Judge(texts("yes", "No.", "hmm"))
    judge = server.reward(verdict={"unparseable_score": -1.0})
    scores, metrics = score(judge, ["5", "6", "7"], [exact_answer])
    assert [r["prompt"] for r in server.requests] == [
        [TEMPLATE.format(prompt="2+3=", completion=c, reference="5") for c in "567"]
    ]
    assert server.requests[0]["model"] == "base-model" and server.requests[0]["temperature"] == 0.0
    assert scores.per_func["j"] == [1.0, 0.0, -1.0] and scores.rewards == [2.0, 0.0, -1.0]
    assert metrics["judge/j/requests"] == 1 and metrics["judge/j/samples"] == 3
    assert metrics["judge/j/unparseable"] == 1 and metrics["judge/j/failed"] == 0 and metrics[FAILED_TOTAL] == 1


def fails(body):
    return httpx.Response(500, json={"error": {"message": "engine died"}})


def times_out(body):
    raise httpx.ReadTimeout("judge took too long")


def garbage(body):
    return httpx.Response(200, json={"choices": "not a list"})


def too_few(body):
    return texts("yes")(body)


@pytest.mark.parametrize("answer", [fails, times_out, garbage, too_few])
def test_a_judge_that_raises_times_out_or_answers_garbage_costs_its_group_the_fallback_counted(answer):
    judge = Judge(answer).reward(fallback_score=0.5)
    scores, metrics = score(judge, ["5", "6"], [exact_answer])
    assert scores.per_func["j"] == [0.5, 0.5] and scores.rewards == [1.5, 0.5]
    assert not scores.errors  # the judge scored its samples: no reward function failed
    assert metrics["judge/j/failed"] == 2 and metrics[FAILED_TOTAL] == 2


def test_every_judges_failures_add_up_in_failed_total():
    good, bad = Judge(texts("yes", "what")).reward("good"), Judge(fails).reward("bad")
    _, metrics = score(good, ["5", "6"], [bad])
    assert metrics["judge/good/unparseable"] == 1 and metrics["judge/bad/failed"] == 2 and metrics[FAILED_TOTAL] == 3


def scored_by_last_token(body):
    """p(yes) 0.6 and p(no) 0.2 after a prompt that shows the completion 5; 0.1 and 0.7 after any other."""
    choices = []
    for i, seq in enumerate(body["prompt"]):
        right = "A: 5 " in "".join(map(chr, seq[:-1]))
        yes_no = {ord("Y"): (0.6, 0.1), ord("N"): (0.2, 0.7)}[seq[-1]][0 if right else 1]
        positions = (
            [None] + [{str(t): {"logprob": -1.0}} for t in seq[1:-1]] + [{str(seq[-1]): {"logprob": math.log(yes_no)}}]
        )
        choices.append({"index": i, "text": "", "finish_reason": "length", "prompt_logprobs": positions})
    return httpx.Response(200, json={"choices": choices})


def test_a_logprob_judge_scores_yes_against_no_in_one_pass():
    server = Judge(scored_by_last_token)
    judge = server.reward(tokenizer=Tokens(), verdict={"kind": "logprob", "yes_token": "Y", "no_token": "N"})
    scores, metrics = score(judge, ["5", "6"])
    assert scores.per_func["j"] == [pytest.approx(0.75), pytest.approx(0.125)]
    (request,) = server.requests
    assert request["max_tokens"] == 1 and request["prompt_logprobs"] == 0 and len(request["prompt"]) == 4
    assert metrics["judge/j/requests"] == 1 and metrics[FAILED_TOTAL] == 0
    with pytest.raises(ValueError, match=r"judges.j.verdict.yes_token=' yes' is 4 tokens .* name one token"):
        server.reward(tokenizer=Tokens(), verdict="logprob")


def in_process(client: TestClient) -> httpx.MockTransport:
    """A transport that hands each request to the app behind `client` (the judge's client is a sync one)."""

    def forward(request: httpx.Request) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        r = client.request(
            request.method, request.url.path, params=request.url.params, content=request.content, headers=headers
        )
        return httpx.Response(r.status_code, headers={"content-type": r.headers["content-type"]}, content=r.content)

    return httpx.MockTransport(forward)


@pytest.fixture
def shared_fleet():
    """The fleet's real ingress over a fake backend, with runs alice and bob registered: a transport into it, the
    backend, and bob's token."""
    backend = FakeBackend()
    client = TestClient(make_app(backend, api_settings(max_loras=7, max_staleness=1)))
    register(client, "alice")
    return in_process(client), backend, register(client, "bob")


def test_a_judge_naming_another_runs_adapter_is_refused_403_at_start_and_scores_nothing(shared_fleet):
    transport, backend, bob = shared_fleet
    overrides = ["judges={j: {model: alice/policy-v1, template: 'is {completion} right'}}", "task.reward_funcs=[j]"]
    cfg = load_config(None, overrides)
    with pytest.raises(
        JudgeRefused, match=r"judges.j: alice/policy-v1 at http://testserver .*403.*belongs to run 'alice'"
    ):
        probe_judges(cfg, "http://testserver", bob, "", transport=transport)
    # Had it got past the start, every group would score the fallback, counted, and nothing reach alice's adapter.
    judge = JudgeReward("j", cfg.judges["j"], FleetClient("http://testserver", bob, transport=transport))
    assert judge(["ab"], ["cd"], answer=["x"]) == [0.0] and judge.metrics()["judge/j/failed"] == 1
    assert not [c for c in backend.calls if c[0] == "generate"]
    with pytest.raises(FleetError, match="403"):
        judge.probe()


def test_the_start_up_probe_waits_for_a_fleets_first_answer_longer_than_the_judges_timeout(shared_fleet):
    """A fleet just started is slow over its first answers (vLLM compiling for a model new to the machine): the
    probe waits PROBE_TIMEOUT_S for it, while a group's request in training keeps the judge's own `timeout_s`."""
    from app.rollout.judge_probe import PROBE_TIMEOUT_S
    from app.rollout.judges import judge_rewards

    transport, _, bob = shared_fleet
    waits = []

    def recording(request: httpx.Request) -> httpx.Response:
        waits.append(request.extensions["timeout"]["read"])
        return transport.handle_request(request)

    cfg = load_config(None, ["judges={j: {model: base, template: 'is {completion} right'}}", "task.reward_funcs=[j]"])
    probe_judges(cfg, "http://testserver", bob, "", transport=httpx.MockTransport(recording))
    assert waits and set(waits) == {PROBE_TIMEOUT_S} and cfg.judges["j"].timeout_s < PROBE_TIMEOUT_S
    waits.clear()
    (judge,) = judge_rewards(cfg, "http://testserver", bob, transport=httpx.MockTransport(recording)).values()
    judge(["ab"], ["cd"], answer=["x"])
    assert set(waits) == {cfg.judges["j"].timeout_s}


def test_a_judge_that_only_measures_the_heldout_split_is_asked_at_start_too(shared_fleet):
    transport, backend, bob = shared_fleet
    judge = "judges={j: {model: alice/policy-v1, template: 'is {completion} right'}}"
    cfg = load_config(None, [judge, "task.reward_funcs=[exact_answer]", "eval.reward_funcs=[j]"])
    with pytest.raises(JudgeRefused, match=r"judges.j: alice/policy-v1 .*403"):
        probe_judges(cfg, "http://testserver", bob, "", transport=transport)


def test_a_judge_on_the_base_or_the_runs_own_adapter_goes_through_its_token(shared_fleet):
    transport, backend, bob = shared_fleet
    for model, served in (("base", BASE), ("bob/policy-v1", "bob/policy-v1")):
        cfg = load_config(
            None, [f"judges={{j: {{model: {model}, template: 'is {{completion}} right'}}}}", "task.reward_funcs=[j]"]
        )
        probe_judges(cfg, "http://testserver", bob, "", transport=transport)
        judge = JudgeReward("j", cfg.judges["j"], FleetClient("http://testserver", bob, transport=transport))
        assert judge(["ab", "ab"], ["cd", "ef"], answer=["x", "x"]) == [0.0, 0.0]  # the fake answers "fgh": unreadable
        assert judge.metrics()["judge/j/unparseable"] == 2 and judge.metrics()["judge/j/failed"] == 0
        generated = [c[1] for c in backend.calls if c[0] == "generate"]
        assert {r.model for r in generated[-2:]} == {served}
    # Its requests counted in bob's fair share: a probe and a group of two, for each of the two judges.
    runs = FleetClient("http://testserver", bob, transport=transport).router_stats()["runs"]["runs"]
    assert runs["bob"]["requests"] == 6


def test_a_judge_naming_a_deployment_the_fleet_lacks_is_refused_at_start_saying_which_it_has():
    """A judge on a deployment of the fleet names it by its model name; a fleet without one of that name (here one
    with a teacher deployment alone) refuses it at start in one line that says so, which deployments it has, and
    how a fleet gets a judge deployment; the deployment it has judges."""
    from tests.support.fake_fleet import TEACHER

    client = TestClient(
        make_app(FakeBackend(), api_settings(max_loras=7, max_staleness=1, deployed_models=frozenset({TEACHER})))
    )
    transport, bob = in_process(client), register(client, "bob")

    def probed(model: str) -> None:
        judge = f"judges={{j: {{model: {model}, template: 'is {{completion}} right'}}}}"
        probe_judges(load_config(None, [judge, "task.reward_funcs=[j]"]), "http://testserver", bob, "", transport)

    with pytest.raises(JudgeRefused) as refused:
        probed("judge")
    why = str(refused.value)
    assert (
        why.startswith(
            "judges.j: the fleet at http://testserver has no deployment 'judge' (its deployments: teacher) nor an adapter "
            "of that name this run may use; a judge model of the fleet's own is served by its config's judge deployment, "
            "`judge: {name: judge, model: {...}}` ("
        )
        and "\n" not in why
    ), why
    probed(TEACHER)  # a deployment the fleet has: every run's
    with pytest.raises(JudgeRefused, match=r"^judges.j: bob/policy-v7 at http://testserver does not judge: .*404"):
        probed("bob/policy-v7")  # a run's adapter the fleet lacks: what the fleet said, no word of deployments


def test_a_single_turn_run_scores_with_its_judges_through_its_fleet_seat(monkeypatch):
    """The run's sampler asks its judge at the run's fleet with the run's token (an external `url` with its own), and
    scores as many groups at once as it has in flight."""
    from app.kinds.kind import FleetSeat
    from app.kinds.registry import kind_of

    monkeypatch.setenv("SPOTRL_JUDGE_TOKEN", "judge-token")
    judges = (
        "judges={j: {template: '{completion}'}, far: {template: '{completion}', url: 'http://127.0.0.1:9', model: m}}"
    )
    cfg = load_config(None, [judges, "task.reward_funcs=[exact_answer, j, far]", "rollout.max_inflight_tasks=12"])
    sampler = kind_of(cfg).sampler(cfg, Tokens(), None, None, FleetSeat("http://fleet.test", "run-token"))
    try:
        exact, j, far = sampler.scorer.funcs
        assert exact is exact_answer and (j.__name__, far.__name__) == ("j", "far")
        assert (j.client.base_url, j.client._headers) == ("http://fleet.test", {"Authorization": "Bearer run-token"})
        assert (far.client.base_url, far.client._headers) == (
            "http://127.0.0.1:9",
            {"Authorization": "Bearer judge-token"},
        )
        assert sampler.scorer._calls.workers == 12
    finally:
        sampler.close()


def test_an_environment_runs_sampler_asks_its_judges_through_its_fleet_seat_weighted_as_named():
    """spotrl's own environments (and OpenEnv's, the same runner): the judges of `task.reward_funcs` alone, each with
    its weight, the environment rewarding the rest; a TRL environment's: its reward functions, the judge among them."""
    from app.kinds.kind import FleetSeat
    from app.kinds.registry import kind_of
    from tiny.tokenizer import build_tokenizer

    seat = FleetSeat("http://fleet.test", "run-token")
    judged = ["judges={j: {template: '{transcript}'}}", "rollout.max_inflight_tasks=12"]
    weighted = ["task.reward_funcs=[exact_answer, j]", "task.reward_weights=[1.0, 0.25]"]
    cfg = load_config(None, [*judged, *weighted, "env.name=calculator"])
    sampler = kind_of(cfg).sampler(cfg, Tokens(), None, None, seat)
    try:
        (j,) = sampler.judges.funcs
        assert j.__name__ == "j" and sampler.judges.weights == [0.25] and sampler.judges._calls.workers == 12
        assert (j.client.base_url, j.client._headers) == ("http://fleet.test", {"Authorization": "Bearer run-token"})
    finally:
        sampler.close()
    cfg = load_config(None, [*judged, *weighted, "env.factory=examples.trl_calculator:CalculatorEnv"])
    sampler = kind_of(cfg).sampler(cfg, build_tokenizer(2, 0), None, None, seat)
    try:
        exact, j, get_reward = sampler.scorer.funcs
        assert exact is exact_answer and j.__name__ == "j" and j.client.base_url == "http://fleet.test"
        assert sampler.scorer.weights == [1.0, 0.25, 1.0] and sampler.scorer._calls.workers == 12
    finally:
        sampler.close()
    plain = load_config(None, ["env.name=calculator"])
    assert kind_of(plain).sampler(plain, Tokens(), None, None, seat).judges is None  # no judge, no scorer


def test_a_logprob_judges_tokens_are_checked_against_the_runs_tokenizer_at_start(tiny_model_path):
    from app.tasks.checks import check_episode_budget

    judged = ["task.reward_funcs=[j]"]
    check_episode_budget(
        load_config(
            None,
            [
                "judges={j: {template: '{completion}', verdict: {kind: logprob, yes_token: '1', no_token: '0'}}}",
                *judged,
            ],
        ),
        tiny_model_path,
    )
    with pytest.raises(ConfigError, match=r"judges.j.verdict.yes_token=' yes' is 4 tokens of the judge's tokenizer"):
        check_episode_budget(
            load_config(None, ["judges={j: {template: '{completion}', verdict: logprob}}", *judged]), tiny_model_path
        )


@pytest.fixture
def answering_fleet(monkeypatch):
    """A fleet on loopback that answers each held-out problem right (`app.evaluate`'s client): its URL; and the
    tokenizer of `Tokens`."""
    import core.models

    def answer(path: str, body: dict | None) -> tuple[int, dict]:
        a, b = re.search(r"(\d+)\+(\d+)", "".join(map(chr, body["prompt"]))).groups()  # Tokens' ids are characters
        right = {"token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "text": str(int(a) + int(b))}
        return 200, {"choices": [{"index": i, **right, "finish_reason": "stop"} for i in range(body["n"])]}

    monkeypatch.setattr(core.models, "load_tokenizer", lambda path: Tokens())
    with answering(answer) as url:
        yield url


JUDGED = ["judges={j: {template: '{completion}'}}", "task.reward_funcs=[j]", "task.num_heldout=4"]


def test_a_judged_run_is_evaluated_by_eval_reward_funcs_and_its_names_are_checked(
    answering_fleet, monkeypatch, tmp_path
):
    """Held-out accuracy is a positive summed reward: a judge's p(yes) is always positive, so a judged run measures
    its held-out split by what `eval.reward_funcs` names (the exact answer), never asking the judge."""
    import app.evaluate as evaluation
    import app.rollout.judges as judges

    monkeypatch.setattr(judges, "judge_client", lambda *a, **k: pytest.fail("the evaluation asked a judge"))
    overrides = JUDGED
    cfg = load_config(None, [*overrides, "eval.reward_funcs=[exact_answer]", f"bucket.url=file://{tmp_path}/bucket"])
    check_names(cfg)
    result = evaluation.evaluate(cfg, answering_fleet, "unused", "policy-v1")
    assert result["num_problems"] == 4 and result["accuracy"] == 1.0, result
    with pytest.raises(ConfigError, match=r"eval.reward_funcs\[0\]: unknown reward function 'nope'.* or a judge"):
        check_names(load_config(None, [*overrides, "eval.reward_funcs=[nope]"]))


def test_a_judged_run_measured_otherwise_reports_each_judges_agreement_with_the_measure(
    answering_fleet, monkeypatch, tmp_path
):
    """The run's own versions (`judged`): each judge it rewards with is asked once for the held-out samples, and says
    how often its verdict is the measure's: here every answer is right and the judge says no to one of four."""
    import app.evaluate as evaluation
    import app.rollout.judges as judges

    server = Judge(texts("no", "yes", "yes", "yes"))
    client = FleetClient("http://judge.test", transport=httpx.MockTransport(server.handler), backoff=Backoff(1, 0.0))
    monkeypatch.setattr(judges, "judge_client", lambda *a, **k: client)
    cfg = load_config(None, [*JUDGED, "eval.reward_funcs=[exact_answer]", f"bucket.url=file://{tmp_path}/bucket"])
    result = evaluation.evaluate(cfg, answering_fleet, "unused", "policy-v1", judged=True)
    assert result["accuracy"] == 1.0 and result["judge_agreement"] == {"j": 0.75}, result
    assert len(server.requests) == 1 and len(server.requests[0]["prompt"]) == 4
    server.answer = lambda body: httpx.Response(503, json={"error": "down"})  # a judge down costs its agreement alone
    result = evaluation.evaluate(cfg, answering_fleet, "unused", "policy-v1", judged=True)
    assert result["accuracy"] == 1.0 and "j" not in result["judge_agreement"]


def test_a_judge_request_handed_back_by_a_noticed_replica_is_answered_elsewhere(monkeypatch):
    """The judge's generation goes through the ingress's real backend (`ServeBackend`): the replica whose node is
    going hands it back after one token ("y"), the ingress continues it on another ("es"), and the judge reads the
    stitched verdict as if nothing happened."""
    import deployments.ingress.shell as ingress
    from contracts.serving import ABORTED, Generated, SampledChoice
    from deployments.ingress.shell import ServeBackend
    from tests.support.serve_handles import GenerateHandle

    monkeypatch.setattr(ingress, "mark_draining", lambda replica: None)
    y, e, s = (ord(c) - ord("a") for c in "yes")  # `api_settings`' vocabulary: a letter's place in the alphabet
    handle = GenerateHandle(
        Generated("a", [SampledChoice(0, [y], [-0.1], None, ABORTED, None)], handed_back=True),
        Generated("b", [SampledChoice(0, [e, s], [-0.1, -0.1], None, "stop", None)]),
    )

    class Draining(FakeBackend):
        def __init__(self):
            super().__init__()
            self.ingress = ServeBackend(handle)

        async def generate(self, request):
            return await self.ingress.generate(request)

    backend = Draining()
    client = TestClient(make_app(backend, api_settings(max_loras=7, max_staleness=1)))
    token = register(client, "bob")
    cfg = load_config(None, ["judges={j: {template: 'is {completion} right'}}", "task.reward_funcs=[j]"])
    judge = JudgeReward("j", cfg.judges["j"], FleetClient("http://testserver", token, transport=in_process(client)))
    judge._model = BASE  # the fake backend lists no models: the judge asks for the base model by its name
    assert judge(["ab"], ["cd"], answer=["x"]) == [1.0]
    assert backend.ingress.spot["handed_back"] == 1 and judge.metrics()["judge/failed_total"] == 0
    assert [r.prompt_ids[-1:] for r in handle.sent][1] == [y]  # the continuation starts after the token handed back
