"""The `judges:` section (`core.config.judges`): what a judge accepts and what it refuses, in the run's config; and the
judge deployment a fleet's config may serve judges by (`judge:`)."""

import pytest

from core.config import ConfigError, load_config, load_fleet_config
from core.config.judges import GenerativeVerdict, JudgeConfig, LogprobVerdict

TEMPLATE = "Q: {prompt} A: {completion} Right?"


def judge(**fields) -> str:
    body = ", ".join(f"{k}: {v}" for k, v in {"template": f"'{TEMPLATE}'", **fields}.items())
    return f"judges={{ok: {{{body}}}}}"


def test_a_judge_names_its_model_template_and_verdict():
    cfg = load_config(None, [judge(verdict="logprob"), "task.reward_funcs=[ok]"])
    ok = cfg.judges["ok"]
    assert ok.model == "base" and ok.url is None and ok.template == TEMPLATE
    assert isinstance(ok.verdict, LogprobVerdict) and (ok.verdict.yes_token, ok.verdict.no_token) == (" yes", " no")
    plain = load_config(None, [judge()]).judges["ok"]
    assert isinstance(plain.verdict, GenerativeVerdict) and plain.verdict.parse == "yes_no"
    regex = load_config(None, [judge(verdict="{parse: regex, pattern: 'score=(\\d+)'}")]).judges["ok"]
    assert regex.verdict.kind == "generative" and regex.verdict.pattern == "score=(\\d+)"
    # What it dumps reads back (a config travels to Ray's actors as itself).
    assert JudgeConfig.model_validate(ok.model_dump()) == ok


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (
            {"template": "'Q: {prompt}'"},
            r"must show the judge the sample it judges \(\{completion\} or \{transcript\}\)",
        ),
        ({"template": "'{completion} {}'"}, "is not a field name"),
        ({"verdict": "{parse: regex}"}, "parse regex needs a pattern"),
        ({"verdict": "{parse: regex, pattern: 'score'}"}, "has no group"),
        ({"verdict": "{parse: regex, pattern: '(x'}"}, "is no regular expression"),
        ({"verdict": "{pattern: '(x)'}"}, "pattern reads a verdict with parse: regex"),
        ({"verdict": "vote"}, "verdict"),
        ({"url": "ftp://x", "model": "m"}, "expected an http:// or https:// URL"),
        ({"url": "http://127.0.0.1:9"}, "name the model `url` serves"),
        ({"url": "http://127.0.0.1:9", "model": "m", "verdict": "logprob"}, "use a generative verdict with url"),
        ({"timeout_s": 6}, r"judges.ok: 2 tries of timeout_s 6.0 take up to 13.5 s, not below task.reward_timeout_s"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_bad_judge_is_a_config_error_in_one_line(fields, why):
    with pytest.raises(ConfigError, match=why) as err:
        load_config(None, [judge(**fields)])
    assert "\n" not in str(err.value).strip()


def test_a_judge_whose_retries_fit_a_longer_reward_timeout_is_taken():
    cfg = load_config(None, [judge(timeout_s=6), "task.reward_timeout_s=20"])
    assert cfg.judges["ok"].budget_s < 20


def test_a_judges_name_never_reads_as_a_module_path():
    with pytest.raises(ConfigError, match="a judge's name is a letter"):
        load_config(None, [f"judges={{'my.mod:f': {{template: '{TEMPLATE}'}}}}"])


def test_a_fleet_serves_a_judge_deployment_of_its_own_named_judge_and_sized_to_the_students_context():
    """`judge:` in a fleet's config: a judge model served by replicas of its own, `judge` by default, without a teacher;
    it reads the student's samples whole, so it gets the student's context unless it names one."""
    fleet = load_fleet_config(None, ["model.max_model_len=96", "judge={model: {name_or_path: j}, num_replicas: 2}"])
    assert (fleet.judge.name, fleet.judge.num_replicas, fleet.judge.model.max_model_len) == ("judge", 2, 96)
    assert fleet.teacher is None and list(fleet.deployments()) == ["judge"]
    replicas = fleet.deployment_fleet("judge")  # its replicas' own config: its model, no deployment of their own
    assert replicas.model.name_or_path == "j" and replicas.fleet.num_replicas == 2 and replicas.judge is None
    named = load_fleet_config(
        None, ["judge={name: grader, model: {name_or_path: j}}", "teacher={model: {name_or_path: t}}"]
    )
    assert list(named.deployments()) == ["teacher", "judge"] and named.judge.name == "grader"


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (
            ["teacher={name: critic, model: {name_or_path: t}}", "judge={name: critic, model: {name_or_path: j}}"],
            "judge.name='critic' is teacher.name too: a request reaches a deployment by its model name, so each needs "
            "a name of its own",
        ),
        (
            ["model.max_model_len=256", "judge={model: {name_or_path: j, max_model_len: 128}}"],
            "judge.model.max_model_len=128 is shorter than the student's model.max_model_len=256: the judge could not "
            "read the longer samples; give it at least that",
        ),
        (["judge={name: 'a b', model: {name_or_path: j}}"], "judge.name"),
    ],
)
def test_a_judge_deployment_the_fleet_could_not_serve_is_a_config_error_in_one_line(overrides, why):
    with pytest.raises(ConfigError) as err:
        load_fleet_config(None, overrides)
    assert why in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)
