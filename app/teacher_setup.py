"""A distilling run's teacher at start: where it is served, that it gives the student's token ids, that it scores
the same sequence the same twice. The driver calls `prepare_teacher` once; what it answers goes to the rollout.

The four kinds (`core.config.teacher`) end up as one `TeacherEndpoint`, a server and a model name:
- `base`: the run's fleet, under the base model's name (the first model of its `/v1/models`);
- `adapter`: the run's fleet, which loads it as `teacher-v0` now (its own fleet trusts where it comes from:
  `RunConfig.own_fleet`);
- `model`: the run's fleet, under the teacher deployment's name (`deployments.replica.teacher` built it and compared
  its tokenizer already; a fleet that was running before this run must have it too);
- `url`: the teacher's own server, with its first model unless `served_model` says otherwise.

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

from app.evaluate import base_model_name
from app.fleet_client import FleetClient, FleetError
from app.objectives.distill import teacher_top_k
from app.rollout.teacher import TEACHER_TOKEN_ENV, TeacherEndpoint
from app.tasks.problems import load_task
from contracts.auth import Secret
from core.config import ConfigError
from core.config.teacher import TEACHER_ADAPTER
from core.models import check_same_token_ids, check_same_tokenizer, load_tokenizer, resolve_model_path

log = logging.getLogger("spotrl.teacher")


def refuse(why: str) -> SystemExit:
    return SystemExit(f"objectives: distill teacher refused: {why}")


def prepare_teacher(cfg, fleet: FleetClient, model_path: str, token: str | None) -> TeacherEndpoint:
    """The run's teacher, resolved, loaded where it has to be, checked: or SystemExit naming why it is refused."""
    teacher, student = cfg.teacher, load_tokenizer(model_path)
    fleet_token = Secret(token) if token else None
    try:
        match teacher.kind:
            case "base":
                endpoint = TeacherEndpoint("base", fleet.base_url, base_model_name(fleet), fleet_token)
            case "adapter":
                fleet.load_adapter(TEACHER_ADAPTER, teacher.adapter)
                endpoint = TeacherEndpoint("adapter", fleet.base_url, TEACHER_ADAPTER, fleet_token, teacher.adapter)
            case "model":
                endpoint = _deployed_teacher(cfg, fleet, student, fleet_token)
            case _:
                endpoint = _teacher_server(teacher, student)
    except FleetError as e:
        raise refuse(f"{teacher.kind} {teacher.adapter or teacher.url or ''}: {e}") from None
    except ConfigError as e:
        raise refuse(str(e)) from None
    self_test(
        endpoint, probe_sequence(cfg, student), teacher.self_test_tolerance, cfg.grpo.temperature, teacher_top_k(cfg)
    )
    log.info("teacher: %s %s at %s, checked", endpoint.kind, endpoint.model, endpoint.url)
    return endpoint


def _deployed_teacher(cfg, fleet: FleetClient, student, token: Secret | None) -> TeacherEndpoint:
    """A `model` teacher: the fleet's teacher deployment, which must be there and of the student's tokenizer."""
    deployment = cfg.teacher.deployment()
    check_same_tokenizer(student, resolve_model_path(deployment.model, cfg.task), "teacher.model")
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


def probe_sequence(cfg, tokenizer) -> list[int]:
    """A sequence a student might sample: the first held-out problem's prompt, its answer and EOS."""
    problem = load_task(cfg.task).heldout[0]
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
            f"run samples at grpo.temperature {temperature}: its scores would be compared with tempered samples' "
            f"log-probs; serve the teacher from a spotrl fleet, which scores at the request's temperature, or sample at 1"
        )
    return worst
