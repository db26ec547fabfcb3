"""A fleet's model deployments beside the base model's (`deployments.replica.teacher`): a teacher's and a judge's
built by one builder, each on the cores after the last, each reached by the ingress under its own model name; one
whose tokenizer is not the base model's refused before anything starts."""

import asyncio
import inspect

import pytest

from contracts.serving import TEACHER_DEPLOYMENT, Generated, GenerateRequest, Sampling
from core.config import ConfigError, load_fleet_config
from tests.support.serve_handles import GenerateHandle


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Model folders (their tokenizers are all the builder reads): the base's, a judge's and a teacher's of the same
    tokenizer, and one of another."""
    from tiny.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("models")
    same, other = build_tokenizer(2, 0), build_tokenizer(2, 0, vocab_size=320)
    paths = {}
    for name, tokenizer in (("base", same), ("judge", same), ("teacher", same), ("other", other)):
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _deployed(cfg, base: str) -> dict:
    """The model deployments `fleet_app` hands the ingress: their bound deployments by model name."""
    from deployments.fleet import fleet_app
    from deployments.ingress.shell import Ingress

    ingress = fleet_app(cfg, base)._bound_deployment
    bound = inspect.signature(Ingress.__init__).bind(None, *ingress.init_args, **ingress.init_kwargs)
    return {name: app._bound_deployment for name, app in bound.arguments["deployed"].items()}


def test_a_judge_deployment_is_built_as_the_teachers_on_the_cores_after_it(folders):
    from deployments.replica.teacher import JUDGE_DEPLOYMENT

    cfg = load_fleet_config(
        None,
        [
            "fleet.num_replicas=2",
            f"teacher={{model: {{name_or_path: '{folders['teacher']}'}}, num_replicas: 2}}",
            f"judge={{name: grader, model: {{name_or_path: '{folders['judge']}'}}}}",
        ],
    )
    deployed = _deployed(cfg, folders["base"])
    assert list(deployed) == ["teacher", "grader"]
    teacher, judge = deployed["teacher"], deployed["grader"]
    assert (teacher.name, teacher.num_replicas, judge.name, judge.num_replicas) == (
        TEACHER_DEPLOYMENT,
        2,
        JUDGE_DEPLOYMENT,
        1,
    )
    # Each serves its own model under its name, with the fleet's settings, no lineage, no deployment of its own.
    path, name, config = judge.init_args[:3]
    assert (path, name) == (folders["judge"], "grader")
    assert config["model"]["name_or_path"] == folders["judge"] and config["fleet"]["num_replicas"] == 1
    assert config["teacher"] is None and config["judge"] is None
    assert teacher.init_args[:2] == (folders["teacher"], "teacher")
    # The base model's 2 replicas pin cores 0-1, the teacher's 2-3, the judge's 4.
    assert teacher.init_kwargs == {"first_rank": 2, "lineage": False}
    assert judge.init_kwargs == {"first_rank": 4, "lineage": False}


def test_a_fleet_may_serve_a_judge_without_a_teacher(folders):
    cfg = load_fleet_config(None, ["fleet.num_replicas=1", f"judge={{model: {{name_or_path: '{folders['judge']}'}}}}"])
    deployed = _deployed(cfg, folders["base"])
    assert list(deployed) == ["judge"] and deployed["judge"].init_kwargs["first_rank"] == 1
    assert _deployed(load_fleet_config(None, ["fleet.num_replicas=1"]), folders["base"]) == {}


def test_a_judge_of_another_tokenizer_is_refused_before_anything_starts(folders):
    from deployments.fleet import fleet_app

    cfg = load_fleet_config(None, [f"judge={{model: {{name_or_path: '{folders['other']}'}}}}"])
    with pytest.raises(ConfigError, match=r"^judge 'judge' \(.*other\): the vocabulary of .* is not the student's"):
        fleet_app(cfg, folders["base"])


def test_the_ingress_sends_a_request_to_the_deployment_its_model_names():
    from deployments.ingress.shell import ServeBackend

    base, teacher, judge = (GenerateHandle(Generated(name, [])) for name in ("base", "teacher", "judge"))
    backend = ServeBackend(base, deployed={"teacher": teacher, "judge": judge})
    for model, handle, served_by in (
        ("judge", judge, "judge"),
        ("teacher", teacher, "teacher"),
        ("p-v1", base, "base"),
    ):
        request = GenerateRequest([1, 2], model, Sampling())
        assert asyncio.run(backend.generate(request)).replica == served_by
        assert handle.sent == [request]
