"""A distilling run's teacher at start: where it is served, that it gives the student's token ids, that it scores
the same sequence the same twice. The driver calls `prepare_teacher` once; what it answers goes to the rollout.

The four kinds (`core.config.teacher`) end up as one `TeacherEndpoint`, a server and a model name:
- `base`: the run's fleet, under the base model's name (the first model of its `/v1/models`);
- `adapter`: the run's fleet, which loads it as `teacher-v0` now (its own fleet trusts where it comes from:
  `RunConfig.own_fleet`);
- `model`: the run's fleet, under the teacher deployment's name (`deployments.replica.teacher` built it and compared
  its tokenizer already; a fleet that was running before this run must have it too);
- `url`: the teacher's own server, with its first model unless `served_model` says otherwise;
- `self`: the run's fleet, under the base model's name (`base`), the run's own newest version (`live`) or that
  version's number of the run's ema lineage (`ema`, the average its learner publishes beside it), scoring
  under the privileged prompt its `context` template renders; a template that names a field the task's problems do
  not have, or leave empty, is refused here, in one line.

Refused at start, with a message that says why: a teacher whose tokenizer gives other ids than the student's
(a local folder's vocabulary and probe texts, or a server's `/tokenize`), a server with no `/tokenize` to
compare, a teacher the fleet cannot load, one whose two scorings of one sequence differ beyond
`teacher.self_test_tolerance`, leave a token unscored or (top-k distillation) answer fewer than `top_k`
alternatives per token, and, in a run that samples at a temperature other than 1, one that scores at 1 whatever
it is asked (plain vLLM 0.32 does): its scores would be compared with tempered samples.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import replace

from app.evaluate import base_model_name
from app.fleet_client import FleetClient, FleetError
from app.kinds.registry import problems_of
from app.objectives.distill import teacher_top_k
from app.rollout.teacher import TEACHER_TOKEN_ENV, TeacherEndpoint
from app.tasks.privileged import check_context, privileged_problem
from contracts.adapters import EMA_STEM, in_lineage
from contracts.auth import Secret
from core.config import ConfigError
from core.config.teacher import TEACHER_ADAPTER
from core.models import check_same_token_ids, check_same_tokenizer, load_tokenizer, resolve_model_path

log = logging.getLogger("spotrl.teacher")

DEFAULT_TEACHER = "default"  # of several teachers, the one a problem that names none gets
CHECKED_PROBLEMS = 256  # of each split, whose fields a self teacher's template is checked against at start


def refuse(why: str) -> SystemExit:
    return SystemExit(f"objectives: distill teacher refused: {why}")


def prepare_teachers(
    cfg, fleet: FleetClient, model_path: str, token: str | None, policy_model: str | None = None
) -> dict[str, TeacherEndpoint]:
    """The run's teachers by name (`RunConfig.teachers`), each prepared by `prepare_teacher`; with several, every
    problem must name one of them in its `teacher_field` column, or the run have one named `default`."""
    teachers = cfg.teachers
    if cfg.distill.teachers is not None:
        splits = problems_of(cfg)
        check_teacher_choice(cfg.distill.teacher_field, teachers, splits.train + splits.heldout)
    return {
        name: prepare_teacher(cfg, fleet, model_path, token, policy_model, teacher, name)
        for name, teacher in teachers.items()
    }


def check_teacher_choice(field: str, teachers, problems) -> None:
    """SystemExit (one line) when a problem names no teacher of `teachers` by its `field` column (a problem without
    it goes to the teacher named `default`)."""
    for problem in problems:
        name = problem.columns.get(field, DEFAULT_TEACHER)
        if name not in teachers:
            raise refuse(
                f"problem {problem.id!r} names teacher {name!r} by its {field!r} column; the run has "
                f"{', '.join(sorted(teachers))}"
                + ("" if DEFAULT_TEACHER in teachers else f" (and no {DEFAULT_TEACHER!r})")
            )


def prepare_teacher(
    cfg,
    fleet: FleetClient,
    model_path: str,
    token: str | None,
    policy_model: str | None = None,
    teacher=None,
    name: str | None = None,
) -> TeacherEndpoint:
    """A teacher of the run (`teacher`, by default the run's one), resolved, loaded where it has to be, checked: or
    SystemExit naming why it is refused. `policy_model` is the run's newest version now (a `live` self teacher's
    first)."""
    teacher, student = teacher or cfg.teacher, load_tokenizer(model_path)
    fleet_token = Secret(token) if token else None
    try:
        match teacher.kind:
            case "base":
                endpoint = TeacherEndpoint("base", fleet.base_url, base_model_name(fleet), fleet_token)
            case "self":
                endpoint = _self_teacher(cfg, teacher.self_teacher, fleet, fleet_token, policy_model)
            case "adapter":
                fleet.load_adapter(TEACHER_ADAPTER, teacher.adapter)
                endpoint = TeacherEndpoint("adapter", fleet.base_url, TEACHER_ADAPTER, fleet_token, teacher.adapter)
            case "model":
                endpoint = _deployed_teacher(cfg, teacher, fleet, student, fleet_token)
            case _:
                endpoint = _teacher_server(teacher, student)
    except FleetError as e:
        raise refuse(f"{teacher.kind} {teacher.adapter or teacher.url or ''}: {e}") from None
    except ConfigError as e:
        raise refuse(str(e)) from None
    probe = probe_sequence(cfg, student, teacher.context)
    self_test(endpoint, probe, teacher.self_test_tolerance, cfg.sampling.temperature, teacher_top_k(cfg))
    log.info("teacher %s: %s %s at %s, checked", name or "", endpoint.kind, endpoint.model, endpoint.url)
    return replace(endpoint, name=name) if name is not None else endpoint


def _self_teacher(cfg, spec, fleet: FleetClient, token: Secret | None, policy_model: str | None) -> TeacherEndpoint:
    """A `self` teacher (`spec`): the base model, the run's own newest version or its ema average of the same number,
    under the privileged prompt, whose
    template must name only what the task's problems have (checked on both splits' first problems)."""
    splits = problems_of(cfg)
    try:
        check_context(spec.context, splits.train[:CHECKED_PROBLEMS] + splits.heldout[:CHECKED_PROBLEMS], "context")
    except ValueError as e:
        raise refuse(f"self: {e}") from None
    feedback = spec.feedback == "last_observation"
    if spec.model == "base":
        return TeacherEndpoint(
            "self", fleet.base_url, base_model_name(fleet), token, context=spec.context, feedback=feedback
        )
    if policy_model is None:
        raise refuse(f"self: a {spec.model} teacher needs the run's newest version")
    ema = spec.model == "ema"
    model = in_lineage(policy_model, EMA_STEM) if ema else policy_model
    return TeacherEndpoint(
        "self", fleet.base_url, model, token, context=spec.context, live=True, ema=ema, feedback=feedback
    )


def _deployed_teacher(cfg, teacher, fleet: FleetClient, student, token: Secret | None) -> TeacherEndpoint:
    """A `model` teacher: the fleet's teacher deployment, which must be there and of the student's tokenizer."""
    deployment = teacher.deployment()
    check_same_tokenizer(student, resolve_model_path(deployment.model), "teacher.model")
    if deployment.name not in {m["id"] for m in fleet.models()}:
        raise refuse(f"the fleet at {fleet.base_url} serves no teacher {deployment.name!r} (started without it?)")
    return TeacherEndpoint("model", fleet.base_url, deployment.name, token)


def _teacher_server(teacher, student) -> TeacherEndpoint:
    """A `url` teacher: its model, and its tokenizer compared through its `/tokenize` (vLLM's server has one)."""
    token = os.environ.get(TEACHER_TOKEN_ENV) or None
    server = FleetClient(teacher.url, token, timeout_s=teacher.request_timeout_s)
    try:
        model = teacher.served_model or server.models()[0]["id"]
        try:
            server.tokenize("probe", model)
        except FleetError as e:
            if e.status in (404, 405):
                raise refuse(f"{teacher.url} has no /tokenize to compare its tokenizer with the student's") from None
            raise
        check_same_token_ids(student, lambda text: server.tokenize(text, model), f"teacher.url {teacher.url}")
    finally:
        server.close()
    return TeacherEndpoint("url", teacher.url, model, Secret(token) if token else None)


def probe_sequence(cfg, tokenizer, context: str | None = None) -> list[int]:
    """A sequence a student might sample: the first held-out problem's prompt (a self teacher's privileged one,
    rendered by `context`), its answer and EOS."""
    problem = problems_of(cfg).heldout[0]
    if context is not None:
        problem = privileged_problem(context, problem)
    text = (
        problem.prompt
        if isinstance(problem.prompt, str)
        else tokenizer.apply_chat_template(problem.prompt, tokenize=False)
    )
    ids = tokenizer(text + str(problem.answer), add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def self_test(
    endpoint: TeacherEndpoint, sequence: list[int], tolerance: float, temperature: float = 1.0, top: int = 0
) -> float:
    """Score `sequence` twice, at `temperature` and with `top` alternatives per token (top-k distillation's) as the
    rollout will; refuse a teacher that leaves a token unscored, answers fewer alternatives, or answers differently
    beyond `tolerance` (a teacher that is not deterministic, or not the model it says), and, at a temperature other
    than 1, one whose scores at 1 are the same within `tolerance`: it ignores the temperature (a teacher that tempers
    moves at the probe's unpredictable tokens, its problem's digits). Returns the largest difference of the two
    scorings at `temperature`."""
    temperatures = [temperature, temperature] + ([1.0] if temperature != 1.0 else [])

    async def scorings() -> list[list[dict[int, float] | None]]:
        client = endpoint.client(timeout_s=60.0, retries=2)
        try:
            return [(await client.aprompt_logprobs([sequence], endpoint.model, top, t))[0] for t in temperatures]
        finally:
            await client.aclose()
            client.close()

    try:
        answers = asyncio.run(scorings())
    except FleetError as e:
        raise refuse(f"{endpoint.model} at {endpoint.url} does not score a sequence: {e}") from None
    if top and any(len(at or {}) < top for at in answers[0][1:]):
        raise refuse(f"{endpoint.model} at {endpoint.url} answers fewer than top_k {top} alternatives per token")
    first, second, *at_one = (
        [(at or {}).get(t, math.nan) for at, t in zip(a[1:], sequence[1:], strict=False)] for a in answers
    )
    if len(first) != len(sequence) - 1 or not all(math.isfinite(v) for v in first + second):
        raise refuse(f"{endpoint.model} at {endpoint.url} left tokens of a {len(sequence)}-token sequence unscored")
    worst = max(abs(a - b) for a, b in zip(first, second, strict=True))
    if worst > tolerance:
        raise refuse(
            f"{endpoint.model} scored one sequence twice {worst:.3g} apart (> teacher.self_test_tolerance {tolerance})"
        )
    compared = at_one and len(at_one[0]) == len(first)
    if compared and max(abs(a - b) for a, b in zip(first, at_one[0], strict=True)) <= tolerance:
        raise refuse(
            f"{endpoint.model} at {endpoint.url} scores at temperature 1 whatever it is asked (plain vLLM does), and the "
            f"run samples at sampling.temperature {temperature}: its scores would be compared with tempered samples' "
            f"log-probs; serve the teacher from a spotrl fleet, which scores at the request's temperature, or sample at 1"
        )
    return worst
