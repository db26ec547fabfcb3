"""The Tinker SDK compatibility matrix (issue 43, item 15), generated: every public method of the installed SDK's
`ServiceClient`, `TrainingClient`, `SamplingClient` and `RestClient` (found by introspection, so a method a new SDK
adds fails here until it has a call below) is called against the service, and what it came to, supported or the
error the SDK raised, is written as docs/tinker-compatibility.md. The test fails when the committed doc differs from
what it generates, so the doc cannot drift; `TINKER_COMPAT_WRITE=1` writes it instead:

    TINKER_COMPAT_WRITE=1 .venv/bin/pytest tests/integration/test_tinker_compatibility.py

Each `_async` twin is called as its sync method is, awaited in an event loop of its own.
"""

import asyncio
import base64
import inspect
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import tinker
from tinker import types

from tests.integration import test_tinker_api
from tests.integration.test_tinker_api import RANK, sft_datum

# The service `test_tinker_api` starts (a fleet, a learner, keys alice and bob), started again for this module.
service, notice_file = test_tinker_api.service, test_tinker_api.notice_file

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker-compatibility.md"
CLASSES = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
# What a supported method does that the matrix alone would not say.
NOTES = {
    "get_console_url": "a link to Thinking Machines' console, which does not know this service",
    "get_telemetry": "the SDK's telemetry is accepted and dropped: nothing leaves the machine",
    "get_tokenizer": "loads the base model's tokenizer by its name (docs/tinker-api.md)",
    "on_queue_state_change": "the SDK's own logging of a queue state; no request",
    "get_sampler_handle": "no request: the handle is built by the SDK",
    "forward_backward_custom": "the SDK runs it as a forward, then a `cross_entropy` backward",
}


@dataclass
class Probe:
    """What the calls need: a key's clients, a training client one step in, and a path of each kind."""

    url: str
    key: str
    base: str
    service: tinker.ServiceClient
    rest: tinker.RestClient
    training: tinker.TrainingClient
    sampler: tinker.SamplingClient
    data: list[types.Datum]
    prompt: types.ModelInput
    state: str
    sampled: str
    exported: str
    names: itertools.count
    own_clients: list[tinker.ServiceClient] = field(default_factory=list)

    def own_client(self) -> tinker.ServiceClient:
        """A ServiceClient of its own for a call that opens a training client: closed after the call, so the key's
        limit of training clients is never what a later call of the matrix meets."""
        self.own_clients.append(tinker.ServiceClient(base_url=self.url, api_key=self.key))
        return self.own_clients[-1]

    def close_own_clients(self) -> None:
        while self.own_clients:
            self.own_clients.pop().close("success").result(timeout=120)

    def name(self) -> str:
        return f"compat-{next(self.names)}"

    def fresh_state(self) -> str:
        return self.training.save_state(self.name()).result().path


def weighted_nll(data, logprobs_list):
    loss = -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list, strict=True))
    return loss, {}


def per_datum_nll(logprobs, weights):
    return -(logprobs * weights).sum(), {}


def service_calls(p: Probe) -> dict:
    """ServiceClient: each method's (object, args, kwargs)."""
    s = p.service
    return {
        "close": lambda: (tinker.ServiceClient(base_url=p.url, api_key=p.key), ("success",), {}),
        "copy_weights": lambda: (s, (p.sampled,), {}),
        "create_custom_loss": lambda: (s, (per_datum_nll, {"weights": 1}), {}),
        "create_lora_training_client": lambda: (p.own_client(), (), {"base_model": p.base, "rank": RANK}),
        "create_rest_client": lambda: (s, (), {}),
        "create_sampling_client": lambda: (s, (), {"model_path": p.sampled}),
        "create_training_client_from_state": lambda: (p.own_client(), (p.state,), {}),
        "create_training_client_from_state_with_optimizer": lambda: (p.own_client(), (p.state,), {}),
        "get_console_url": lambda: (s, (), {}),
        "get_server_capabilities": lambda: (s, (), {}),
        "get_telemetry": lambda: (s, (), {}),
    }


def training_calls(p: Probe) -> dict:
    t = p.training
    return {
        "create_sampling_client": lambda: (t, (p.sampled,), {}),
        "forward": lambda: (t, (p.data, "cross_entropy"), {}),
        "forward_backward": lambda: (t, (p.data, "cross_entropy"), {}),
        "forward_backward_custom": lambda: (t, (p.data, weighted_nll), {}),
        "get_console_url": lambda: (t, (), {}),
        "get_info": lambda: (t, (), {}),
        "get_telemetry": lambda: (t, (), {}),
        "get_tokenizer": lambda: (t, (), {}),
        "load_state": lambda: (t, (p.state,), {}),
        "load_state_with_optimizer": lambda: (t, (p.state,), {}),
        "optim_step": lambda: (t, (types.AdamParams(learning_rate=1e-4),), {}),
        "save_state": lambda: (t, (p.name(),), {}),
        "save_weights_and_get_sampling_client": lambda: (t, (p.name(),), {}),
        "save_weights_external": lambda: (t, (p.name(),), {}),
        "save_weights_for_sampler": lambda: (t, (p.name(),), {}),
    }


def sampling_calls(p: Probe) -> dict:
    from tinker.lib.public_interfaces.sampling_client import QueueState

    c = p.sampler
    return {
        "compute_logprobs": lambda: (c, (p.prompt,), {}),
        "create": lambda: (tinker.SamplingClient, (p.service.holder,), {"base_model": p.base}),
        "from_sampler_handle": lambda: (tinker.SamplingClient, (c.get_sampler_handle(),), {"api_key": p.key}),
        "get_base_model": lambda: (c, (), {}),
        "get_sampler_handle": lambda: (c, (), {}),
        "get_telemetry": lambda: (c, (), {}),
        "get_tokenizer": lambda: (c, (), {}),
        "on_queue_state_change": lambda: (c, (QueueState.ACTIVE, None), {}),
        "sample": lambda: (c, (p.prompt, 2, types.SamplingParams(max_tokens=3)), {}),
    }


def sampler_id(sampler: tinker.SamplingClient) -> str:
    """The sampler's id, as its handle carries it (the SDK keeps it private otherwise)."""
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


def rest_calls(p: Probe) -> dict:
    r = p.rest
    run = p.training.model_id
    session = p.service.holder.get_session_id()
    return {
        "assign_session_project": lambda: (r, (session, "a-project"), {}),
        "copy_weights": lambda: (r, (p.sampled,), {}),
        "delete_checkpoint": lambda: (r, (run, p.fresh_state().split(f"{run}/", 1)[1]), {}),
        "delete_checkpoint_from_tinker_path": lambda: (r, (p.fresh_state(),), {}),
        "export_session_trace": lambda: (r, (session,), {}),
        "get_audit_log": lambda: (r, (), {}),
        "get_billing_usage": lambda: (r, ("2026-01-01", "2026-02-01"), {}),
        "get_current_checkpoint_storage_usage": lambda: (r, (), {}),
        "get_external_weights_urls": lambda: (r, (p.exported,), {}),
        "get_sampler": lambda: (r, (sampler_id(p.sampler),), {}),
        "get_server_capabilities": lambda: (r, (), {}),
        "get_session": lambda: (r, (session,), {}),
        "get_telemetry": lambda: (r, (), {}),
        "get_training_run": lambda: (r, (run,), {}),
        "get_training_run_by_tinker_path": lambda: (r, (p.state,), {}),
        "get_weights_info_by_tinker_path": lambda: (r, (p.state,), {}),
        "list_checkpoints": lambda: (r, (run,), {}),
        "list_sessions": lambda: (r, (), {}),
        "list_training_runs": lambda: (r, (), {}),
        "list_user_checkpoints": lambda: (r, (), {}),
        "publish_checkpoint_from_tinker_path": lambda: (r, (p.exported,), {}),
        "search_sessions": lambda: (r, (types.SessionSearchRequest(),), {}),
        "set_checkpoint_ttl_from_tinker_path": lambda: (r, (p.exported, 7200), {}),
        "unpublish_checkpoint_from_tinker_path": lambda: (r, (p.exported,), {}),
        "whoami": lambda: (r, (), {}),
    }


CALLS = {
    tinker.ServiceClient: service_calls,
    tinker.TrainingClient: training_calls,
    tinker.SamplingClient: sampling_calls,
    tinker.RestClient: rest_calls,
}


def public_methods(cls) -> list[str]:
    return sorted(name for name, member in inspect.getmembers(cls) if not name.startswith("_") and callable(member))


async def settle_async(awaitable):
    result = await awaitable
    while inspect.isawaitable(result):  # an `_async` method's APIFuture
        result = await result
    return result


def call(recipe, name: str) -> None:
    """The method `name` as the recipe of its sync twin says; its future's result, awaited or waited for."""
    owner, args, kwargs = recipe()
    result = getattr(owner, name)(*args, **kwargs)
    if inspect.isawaitable(result) and name.endswith("_async"):
        asyncio.run(settle_async(result))
    elif hasattr(result, "result") and callable(result.result):
        result.result(timeout=120)


IDS = re.compile(
    r"tinker://\S+?(?=['\"\s,)]|$)|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b|\b[0-9a-f]{12,}\b"
)


def refusal(exc: Exception) -> str:
    """The SDK's error as a reader needs it: its class, the HTTP status, the service's reason (ids elided, since
    they differ from run to run)."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    reason = body.get("detail") if isinstance(body, dict) and body.get("detail") else str(exc)
    reason = IDS.sub("…", " ".join(str(reason).split()))
    head = f"`{type(exc).__name__}`" + (f" ({status})" if status else "")
    return f"{head}: {reason[:300]}".replace("|", "\\|")


def matrix(p: Probe) -> dict[str, list[tuple[str, str]]]:
    """Each class's methods and what each came to; a method with no call here is the test's failure."""
    rows = {}
    for cls in CLASSES:
        recipes = CALLS[cls](p)
        missing = [n for n in public_methods(cls) if n.removesuffix("_async") not in recipes]
        assert not missing, f"{cls.__name__} has methods this matrix does not call yet: {missing}"
        rows[cls.__name__] = []
        for name in public_methods(cls):
            try:
                call(recipes[name.removesuffix("_async")], name)
                note = NOTES.get(name.removesuffix("_async"))
                answer = "supported" + (f" ({note})" if note else "")
            except Exception as exc:  # noqa: BLE001 - what the SDK raised is the matrix's entry
                answer = "refused: " + refusal(exc)
            p.close_own_clients()
            rows[cls.__name__].append((name, answer))
    return rows


def render(rows: dict[str, list[tuple[str, str]]]) -> str:
    supported = sum(answer.startswith("supported") for table in rows.values() for _, answer in table)
    total = sum(len(table) for table in rows.values())
    lines = [
        "# Tinker SDK compatibility",
        "",
        "Generated by `tests/integration/test_tinker_compatibility.py`, which calls every public method of the SDK's",
        "four clients against the service on the tiny model and fails when this file differs from what it finds",
        "(`TINKER_COMPAT_WRITE=1` rewrites it). A refusal is the error the SDK raised, with the service's reason",
        "(tinker paths and ids elided). What the supported calls do: [The Tinker API](tinker-api.md).",
        "",
        f"- `tinker` SDK {version('tinker')}; `tinker-cookbook` {version('tinker-cookbook')}, whose supervised and RL",
        "  loops run unchanged against the service (`tests/integration/test_tinker_cookbook.py`).",
        f"- {supported} of {total} methods supported.",
    ]
    for cls, table in rows.items():
        lines += ["", f"## `{cls}`", "", "| method | result |", "| --- | --- |"]
        lines += [f"| `{name}` | {answer} |" for name, answer in table]
    return "\n".join(lines) + "\n"


def test_the_compatibility_matrix_is_what_the_sdk_finds(service):
    fleet, url, keys = service
    client = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    training = client.create_lora_training_client(base_model=fleet.base, rank=RANK, seed=41).result()
    tokenizer = training.get_tokenizer()
    data = [sft_datum(tokenizer, "11+11=", "22")]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    probe = Probe(
        url=url,
        key=keys["alice"],
        base=fleet.base,
        service=client,
        rest=tinker.RestClient(base_url=url, api_key=keys["alice"]),
        training=training,
        sampler=client.create_sampling_client(base_model=fleet.base).result(),
        data=data,
        prompt=types.ModelInput.from_ints(tokenizer.encode("11+11=", add_special_tokens=False)),
        state=training.save_state("compat-state").result().path,
        sampled=training.save_weights_for_sampler("compat-sampler").result().path,
        exported=training.save_weights_external("compat-export").result().path,
        names=itertools.count(),
    )
    generated = render(matrix(probe))
    if os.environ.get("TINKER_COMPAT_WRITE") == "1":
        DOC.write_text(generated)
    assert DOC.exists() and DOC.read_text() == generated, (
        "docs/tinker-compatibility.md differs from what the SDK finds now; rerun with TINKER_COMPAT_WRITE=1 and "
        "commit it:\n" + generated
    )
