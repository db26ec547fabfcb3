"""The kind recipe (`examples/kind_inline.py`): a new kind of environment is one file. Importing it registers the
kind; a run's config then names it, every caller takes its problems and sampler from the registry (the rollout's,
the evaluation's, the checks'), and its sampler plays and scores a group over a scripted fleet."""

import asyncio
import subprocess
import sys

import pytest

from app.kinds.kind import EnvKind
from app.kinds.registry import KINDS, kind_of, problems_of, register_kind, sampler_for
from app.rollout.sampling import CompletionSampler, SamplingArgs
from app.tasks.checks import check_names
from contracts.rollouts import Choice
from core.config import ConfigError
from examples.kind_inline import Config, Inline, InlineRunConfig, main, run_config
from tests.support import REPO
from tests.support.scripted_fleet import decode, encode

KINDS.pop("inline")  # registered by the import above; the fixture below registers it for this module's tests alone


@pytest.fixture(autouse=True, scope="module")
def inline_registered():
    """The recipe's kind while this module runs: other modules see the shipped kinds alone."""
    register_kind(Inline())
    yield
    KINDS.pop("inline", None)


def inline_run(**recipe) -> InlineRunConfig:
    return run_config(Config(num_problems=6, num_heldout=2, **recipe))


def test_importing_the_recipe_registers_its_kind_and_the_config_names_it():
    # Its import is what registers it, in a fresh process as in a Ray worker that unpickles an InlineRunConfig.
    probe = "import examples.kind_inline; from app.kinds.registry import KINDS; print(type(KINDS['inline']).__name__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "Inline", out.stderr[-2000:]
    cfg = inline_run(steps=3)
    assert cfg.env.kind == "inline" and isinstance(kind_of(cfg), Inline) and cfg.train.max_steps == 3
    check_names(cfg)
    assert type(cfg).model_validate(cfg.model_dump()) == cfg  # the config travels to the workers as it is


def test_its_problems_come_from_its_config_through_the_registry():
    problems = problems_of(inline_run())
    assert [p.id for p in problems.heldout] == ["inline-0", "inline-1"] and len(problems.train) == 4
    question, answer = problems.heldout[0].prompt, problems.heldout[0].answer
    a, b = (int(x) for x in question.removeprefix("Compute ").split(".")[0].split("+"))
    assert int(answer) == a + b


def test_its_sampler_plays_and_scores_a_group():
    cfg = inline_run()
    problem = problems_of(cfg).heldout[0]

    async def generate(prompt_ids, model, n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, *, turn=None):
        texts = [problem.answer, "11"]
        return [
            Choice(i, encode(texts[i % 2]), [-0.5] * len(encode(texts[i % 2])), texts[i % 2], "stop") for i in range(n)
        ]

    sampler = sampler_for(cfg, None, generate)
    assert isinstance(sampler, CompletionSampler)
    sampled = asyncio.run(sampler.sample(problem, encode(problem.prompt), "policy-v0", 4, SamplingArgs(6)))
    assert [s.reward for s in sampled.samples] == [1.0, 0.0, 1.0, 0.0]  # exact_answer, the task's reward
    assert decode(sampled.samples[0].completion_ids) == problem.answer


def test_its_check_refuses_a_config_it_cannot_run():
    with pytest.raises(ConfigError, match="env.inline.num_heldout=6: leaves no problem"):
        check_names(run_config(Config(num_problems=6, num_heldout=6)))


def test_the_registry_refuses_a_second_kind_on_a_taken_field_and_names_an_unregistered_one():
    class Impostor(EnvKind):
        field = "name"

        def sampler(self, cfg, tokenizer, generate, decode, fleet):
            raise AssertionError

    with pytest.raises(ValueError, match="env.name: already the field of SpotrlEnvironments"):
        register_kind(Impostor())
    assert register_kind(Inline()) is KINDS["inline"]  # the module imported again (as __main__, say): replaced
    cfg = inline_run()
    KINDS.pop("inline")
    try:
        with pytest.raises(ValueError, match="env.inline: no kind registered"):
            kind_of(cfg)
    finally:
        register_kind(Inline())


def test_its_main_refuses_a_bad_config_in_one_line_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["num_problems=4", "num_heldout=4"])
    assert (
        exit.value.code == 2 and "config error: env.inline.num_heldout=4: leaves no problem" in capsys.readouterr().err
    )
