"""Environment kinds in one registry (`app.kinds.registry`): each kind's config is a field of `EnvConfig`, its
runtime one module of `app.kinds`; every caller takes the run's problems from `problems_of`, so that a verifiers
run's teachers are checked against the taskset's problems; a new kind is one module and one registry line."""

from __future__ import annotations

import pytest
from pydantic import Field

from app.kinds import registry
from app.kinds.kind import EnvKind
from app.kinds.registry import KINDS, kind_of, problems_of, sampler_for
from app.rollout.sampling import CompletionSampler
from app.tasks.problems import Problem, TaskSplits, load_task
from app.tasks.rewards import RewardScorer
from core.config import ConfigError, RunConfig, load_config
from core.config.envs import EnvConfig, env_kind
from core.config.sections import Section

EXAMPLE = "examples.verifiers_arithmetic:ArithmeticTaskset"


def verifiers_run(**more) -> RunConfig:
    cfg = load_config(None, ["task.num_heldout=8", "task.num_train=20"])
    return RunConfig.model_validate(cfg.model_dump() | {"env": {"verifiers": {"taskset": EXAMPLE}}} | more)


def test_every_kind_the_config_names_has_one_runtime():
    assert set(KINDS) == {None, *EnvConfig.kinds()}
    assert all(field == kind.field for field, kind in KINDS.items())
    assert kind_of(load_config(None)).field is None
    assert kind_of(load_config(None, ["env.name=calculator"])).field == "name"


def test_the_runs_problems_come_from_its_kind():
    cfg = load_config(None)
    assert problems_of(cfg) == load_task(cfg.task)
    problems = problems_of(verifiers_run())
    assert len(problems.heldout) == 8 and all(p.id.startswith("vf-") for p in problems.heldout + problems.train)


def test_a_verifiers_runs_teachers_are_checked_against_the_tasksets_problems():
    """Several teachers: each problem names its own by a column; the check must read the problems the run plays
    (the taskset's), not the task's, which the run never sees."""
    from app.teacher_setup import prepare_teachers

    teachers = {"a": "base", "b": {"url": "http://127.0.0.1:1"}}
    cfg = verifiers_run(objectives=[{"kind": "distill", "teachers": teachers}])
    with pytest.raises(SystemExit, match=r"problem 'vf-8-[^']*' names teacher 'default'"):
        prepare_teachers(cfg, None, "", None)


# The worked example of docs/tasks-and-environments.md: a kind whose problems are written in its config.
class InlineConfig(Section):
    """Problems written out in the config, as question and answer."""

    problems: list[tuple[str, str]] = Field(min_length=2, description="(question, answer) pairs; the first held out.")


class Inline(EnvKind):
    field = "inline"

    def problems(self, cfg) -> TaskSplits:
        rows = [Problem(f"inline-{i}", q, a) for i, (q, a) in enumerate(cfg.env.inline.problems)]
        return TaskSplits(train=rows[1:], heldout=rows[:1])

    def check(self, cfg) -> None:
        if any(not a.strip() for _, a in cfg.env.inline.problems):
            raise ConfigError("env.inline.problems: every problem needs an answer")

    def sampler(self, cfg, tokenizer, generate, decode, fleet):
        scorer = RewardScorer.from_names(cfg.task.reward_funcs, cfg.task.reward_timeout_s, cfg.train.max_steps)
        return CompletionSampler(generate, scorer, decode)


class InlineEnvConfig(EnvConfig):  # in spotrl: one field of EnvConfig itself
    inline: InlineConfig | None = env_kind("Problems written out in the config.")


class InlineRunConfig(RunConfig):
    env: InlineEnvConfig = Field(default_factory=InlineEnvConfig, description="The environment.")


def test_a_new_kind_is_one_module_and_one_registry_line(monkeypatch):
    from app.tasks.checks import check_names

    monkeypatch.setitem(registry.KINDS, "inline", Inline())  # the registry line
    cfg = InlineRunConfig(env={"inline": {"problems": [("1+1=", "2"), ("2+2=", "4")]}})
    assert cfg.env.kind == "inline" and InlineEnvConfig.kinds()[-1] == "inline"
    assert [p.id for p in problems_of(cfg).heldout] == ["inline-0"]
    assert isinstance(sampler_for(cfg, None, generate=None), CompletionSampler)
    with pytest.raises(ConfigError, match="every problem needs an answer"):
        check_names(InlineRunConfig(env={"inline": {"problems": [("1+1=", "2"), ("2+2=", " ")]}}))
    with pytest.raises(ValueError, match="one environment, not several"):
        InlineEnvConfig(name="calculator", inline={"problems": [("a", "b"), ("c", "d")]})
