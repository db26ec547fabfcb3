"""The fleet's HTTP API as a plain FastAPI app: OpenAI-compatible inference plus vLLM's admin calls.

It speaks what TRL's AsyncGRPOTrainer (`trl.experimental.async_grpo`) and the `openai` client send:
`/v1/completions` with token-id prompts, `return_token_ids` and `logprobs`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/server_info`, and the admin calls `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/pause`, `/resume`, `/reset_prefix_cache`, each applied to every replica.

Prompts are tokenized here, never by vLLM, with the tokenizer that was checked to round-trip, and
generated tokens are decoded here: what the learner later scores is exactly what was sampled. The
app is independent of Ray (a `Backend` does the generating and broadcasting), so its parsing, auth
and error handling are unit-tested with a fake backend; `deployments.ingress` plugs in Ray Serve.
Handlers are methods of two classes, `InferenceRoutes` and `AdminRoutes`, which differ in who may
call them; the wire format (bodies, response shapes) lives in `deployments.api_schema`. On a shared
fleet a caller is the admin, a registered run, or anonymous (`deployments.runs.Caller`): each handler
checks what that caller may name, so a run's token reaches the base model and its own adapters only.

Errors: a malformed request gets 400 with the reason, an unknown model 404, a missing or wrong
token 401, a body over `fleet.max_request_bytes` 413 (by its Content-Length, without waiting for
it), an admin call whose body is not declared JSON 415; messages never carry the token, and the
bucket's `redact` strips credentials from URLs. No request may crash, stall or open the fleet: what
a body may hold is bounded in `deployments.api_schema`, and the CPU work of a request (parsing,
tokenizing, decoding) runs in a few worker threads (`offload`), never on the event loop that answers
every other request, `/health` included.

Admin calls are not for browsers: a web page the operator visits can send a CORS "simple" request
(a form, or a body-less `fetch`) to 127.0.0.1 without asking, with any cached Basic credentials;
it cannot send `Content-Type: application/json` cross-site without a preflight, which the fleet
never grants. So an admin call must declare JSON, except a body-less one (TRL's `/pause`,
`/resume`) from a client that is no browser: browsers always add `Origin` to a POST.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.config import FleetConfig, FleetSettings
from contracts.adapters import run_prefix, split_run
from contracts.auth import presented_token, redact, token_matches
from contracts.control import (
    AdapterListing,
    Command,
    ListAdapters,
    LoadAdapter,
    Pause,
    Ping,
    ReportEngine,
    ResetPrefixCache,
    Resume,
    UndoLoad,
    UnloadAdapter,
)
from contracts.serving import PAUSE_MODES, Generated, GenerateRequest
from deployments.api_schema import (
    ApiError,
    Body,
    ChatCompletionBody,
    CompletionBody,
    FiniteJSONResponse,
    LoadAdapterBody,
    RequestLimits,
    RunBody,
    TokenText,
    UnloadAdapterBody,
    cached_token_text,
    chat_choice,
    completion_choice,
    parse_body,
    token_id_placeholder,
    usage,
)
from deployments.fair_share import FLEET_TENANT, FairShare
from deployments.runs import ADMIN, ANONYMOUS, Caller, Runs

log = logging.getLogger("ray.serve")

WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="spotrl", Basic realm="spotrl"'}

# The CPU work of requests: a few threads, so that one large prompt neither blocks the event loop nor
# queues every other request behind it. HF fast tokenizers release the GIL while they encode, and are
# safe to share between threads as the ingress uses them (no per-call truncation or padding changes).
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spotrl-ingress")


async def offload(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args))


class Backend(Protocol):
    """What the app needs from the fleet (Ray Serve in production, a fake in unit tests)."""

    async def generate(self, request: GenerateRequest) -> Generated: ...

    async def broadcast(self, command: Command) -> list[Any]:
        """Send `command` to every live replica (`contracts.control`); its typed reply or exception per replica."""
        ...

    async def server_info(self) -> dict[str, Any]: ...

    def router_stats(self) -> dict[str, Any]: ...


@dataclass
class ApiSettings:
    """What the ingress knows about the model it fronts."""

    base_model: str  # the `model` name meaning "no adapter" (listed first by /v1/models)
    base_fingerprint: str  # which model that is (`app.models.model_fingerprint`): runs check theirs against it
    model_aliases: frozenset[str]  # other names accepted for the base model (e.g. "tiny", the folder path)
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    chat_ids: Callable[[list[dict[str, Any]], bool], list[int]]
    admin_token: str | None = None
    bucket_url: str = ""  # where the fleet's own lineage (policy-vN) and its runs' prefixes are, credentials redacted
    protect_inference: bool = False
    num_replicas: int = 1
    limits: RequestLimits = field(default_factory=lambda: RequestLimits.of(FleetSettings()))
    max_loras: int = 4  # LoRA slots per engine: how many runs fit (`deployments.runs`)
    max_staleness: int = 2  # the window (+ 1) of a run that states none, and of the fleet's own lineage
    max_lora_rank: int | None = None  # the largest rank a run may register with
    run_idle_timeout_s: float = 600.0  # a run silent for this long is released
    # Generations in flight on the fleet at once, shared by run weight (`deployments.fair_share`).
    inflight_budget: int = field(default_factory=lambda: FleetConfig().inflight_limit)
    default_run_weight: float = 1.0


def make_app(
    backend: Backend, settings: ApiSettings, runs: Runs | None = None, records=None, gate: FairShare | None = None
) -> FastAPI:
    """The FastAPI app of the fleet, over any `Backend`; `runs` is the registry of its tenants, `records` (an
    `app.bucket.records.RunRecords`) where registrations are kept across restarts of the ingress, `gate` the fair
    share of in-flight generations between them."""
    app = FastAPI(
        title="spotrl fleet",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=FiniteJSONResponse,
    )
    replies = ErrorReplies(settings.admin_token)
    app.add_exception_handler(ApiError, replies.api_error)
    app.add_exception_handler(Exception, replies.unexpected)
    if runs is None:
        runs = Runs.of(settings)
    gate = gate if gate is not None else FairShare(settings.inflight_budget, runs.weight)
    InferenceRoutes(backend, settings, replies.scrub, runs, records, gate).register(app)
    AdminRoutes(backend, settings, replies.scrub, runs, records, gate).register(app)
    return app


class ErrorReplies:
    """Every error as `{"error": {...}}`, with the token and bucket credentials scrubbed from the message."""

    def __init__(self, token: str | None):
        self._token = token

    def scrub(self, message: str) -> str:
        message = redact(message)
        return message.replace(self._token, "***") if self._token else message

    def reply(self, status: int, message: str, kind: str | None = None) -> JSONResponse:
        error = ApiError(status, self.scrub(message), kind)
        return FiniteJSONResponse(error.body(), status, WWW_AUTHENTICATE if status == 401 else None)

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self.reply(exc.status, exc.message, exc.kind)

    async def unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        # A ReplicaError keeps its status; anything else is a 500 that names only the type.
        api_error = as_api_error(exc, "request failed")
        if api_error.status >= 500:
            log.error("fleet ingress: %s on %s: %s", type(exc).__name__, request.url.path, self.scrub(repr(exc))[:2000])
        return self.reply(api_error.status, api_error.message)


Handler = TypeVar("Handler", bound=Callable[..., Any])


def route(verb: str, path: str) -> Callable[[Handler], Handler]:
    """Mark a method of a `_Routes` class as the handler of `verb path`."""

    def mark(handler: Handler) -> Handler:
        handler.route = (verb, path)
        return handler

    return mark


class _Routes:
    """Handlers over one backend; `ADMIN` says whether they need a token (the admin's or a run's) whenever
    an admin token is set. What a run's token may do beyond that, each handler checks (`Caller`)."""

    ADMIN = False

    def __init__(
        self,
        backend: Backend,
        settings: ApiSettings,
        scrub: Callable[[str], str],
        runs: Runs,
        records,
        gate: FairShare,
    ):
        self.backend, self.settings, self.scrub, self.runs, self.records = backend, settings, scrub, runs, records
        self.gate = gate

    def register(self, app: FastAPI) -> None:
        for name in dir(type(self)):
            handler = getattr(self, name)
            if hasattr(handler, "route"):
                verb, path = handler.route
                app.add_api_route(path, handler, methods=[verb], response_model=None)

    def caller(self, request: Request) -> Caller:
        """Who sent `request`: the admin token's holder, a registered run, or anonymous (everyone is the admin
        of a fleet that has no admin token, except a caller who presents a run's token)."""
        header = request.headers.get("authorization")
        token = self.settings.admin_token
        if token and token_matches(header, token):
            return ADMIN
        presented = presented_token(header)
        run = self.runs.run_of(presented) if presented else None
        if run is not None:
            return Caller(run=run)
        return ANONYMOUS if token else ADMIN

    async def authorize(self, request: Request) -> Caller:
        await self.release_idle_runs()
        caller = self.caller(request)
        if caller is ANONYMOUS and (self.ADMIN or self.settings.protect_inference):
            raise ApiError(401, "missing or invalid token (send Authorization: Bearer <token>, or Basic auth)")
        return caller

    async def release_idle_runs(self) -> None:
        """Release the runs gone silent for `fleet.run_idle_timeout_s` (`deployments.runs`): whichever request
        comes first after the timeout frees their slots, before it needs any itself."""
        for name in self.runs.take_idle():
            log.warning("fleet ingress: run %s sent nothing for %.0fs: released", name, self.runs.idle_timeout_s)
            try:
                if self.records is not None:
                    await offload(self.records.delete, name)
                await unload_run(self.backend, name)
            except Exception as e:  # noqa: BLE001 - not this request's failure; its adapters still leave by LRU
                log.warning(
                    "fleet ingress: released run %s, could not unload its adapters: %s", name, self.scrub(repr(e))
                )

    async def body(self, request: Request, schema: type[Body]) -> Body:
        limits = self.settings.limits
        raw = await read_body(request, limits.max_request_bytes)
        return await offload(parse_body, raw, schema, limits.max_json_depth)


class InferenceRoutes(_Routes):
    """Generation and read-only calls: open, unless `protect_inference` puts them behind the token."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._token_text = cached_token_text(self.settings.decode)

    # ---- helpers ----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, caller: Caller) -> Generated:
        """One generation, once the caller's run has a place in the fleet (`deployments.fair_share`)."""
        try:
            async with self.gate.slot(tenant_of(caller)) as used:
                result = await self.backend.generate(request)
                used.prompt_tokens = len(request.prompt_ids)
                used.completion_tokens = sum(len(c.token_ids) for c in result.choices)
                return result
        except Exception as e:  # a ReplicaError keeps its status (404 unknown model, 400, 503); others are 500
            api_error = as_api_error(e, "generation failed")
            if api_error.status >= 500:
                log.error("fleet ingress: generation failed: %s", self.scrub(repr(e))[:2000])
            raise api_error from None

    def resolve_model(self, name: str) -> str:
        """The base model's aliases are one name, so the router hashes one namespace for all of them."""
        base = self.settings.base_model
        return base if name in self.settings.model_aliases or name == base else name

    def check_vocabulary(self, ids: list[int], what: str) -> None:
        """Every id a token of the model: an id beyond the embedding table crashes an engine."""
        vocab = self.settings.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{what}: token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def room(self, ids: list[int], max_tokens: int | None) -> int:
        """`max_tokens` for a valid prompt `ids`: the one asked for, or all the room the context leaves."""
        limit = self.settings.max_model_len
        if not ids:
            raise ApiError(400, "prompt: empty")
        self.check_vocabulary(ids, "prompt")
        room = limit - len(ids)
        if room < 1:
            raise ApiError(400, f"prompt: {len(ids)} tokens leave no room within max_model_len {limit}")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens: {max_tokens} + {len(ids)} prompt tokens exceed max_model_len {limit}")
        return max_tokens if max_tokens is not None else room

    # The job builders tokenize and check every token id: they run in a worker thread (`offload`).

    def completion_jobs(self, body: CompletionBody, prompts: list[str | list[int]]) -> list[GenerateRequest]:
        """The engine's request for each prompt, tokenized and checked; a text the tokenizer refuses is a 400."""
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids")
        try:
            id_lists = [self.settings.encode(p) if isinstance(p, str) else p for p in prompts]
        except Exception as e:
            raise ApiError(400, f"prompt: cannot tokenize ({type(e).__name__})") from None
        model = self.resolve_model(body.model)
        return [
            GenerateRequest(ids, model, body.sampling(self.room(ids, body.max_tokens), body.logprobs), body.turn)
            for ids in id_lists
        ]

    def chat_job(self, body: ChatCompletionBody, messages: list[dict[str, str]]) -> GenerateRequest:
        """The engine's request for a conversation, through the chat template."""
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids")
        try:
            ids = self.settings.chat_ids(messages, body.add_generation_prompt)
        except ApiError:
            raise
        except Exception as e:  # the chat template rejected the conversation
            raise ApiError(400, f"messages: cannot apply the chat template ({type(e).__name__}: {e})") from None
        max_tokens = self.room(ids, body.max_completion_tokens or body.max_tokens)
        return GenerateRequest(ids, self.resolve_model(body.model), body.sampling(max_tokens, body.top_alternatives()))

    def token_text(self, asked: bool, as_ids: bool | None) -> TokenText | None:
        """How log-prob listings name tokens: not at all unless `asked`; by id alone if the client said so."""
        if not asked:
            return None
        return token_id_placeholder if as_ids else self._token_text

    # ---- handlers ---------------------------------------------------------------------------

    @route("POST", "/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        caller = await self.authorize(request)
        body = await self.body(request, CompletionBody)
        caller.check_use(self.resolve_model(body.model), self.settings.base_model)
        prompts = body.prompts()
        limits = self.settings.limits
        limits.check_fanout(len(prompts), body.n)
        limits.check_text(p for p in prompts if isinstance(p, str))
        jobs = await offload(self.completion_jobs, body, prompts)
        id_lists = [job.prompt_ids for job in jobs]
        results = await asyncio.gather(*(self.generate(job, caller) for job in jobs))
        choices = await offload(self.completion_choices, body, id_lists, results)
        reply = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage(sum(len(ids) for ids in id_lists), [c for r in results for c in r.choices]),
        }
        return FiniteJSONResponse(reply, headers=replica_header(results))

    def completion_choices(
        self, body: CompletionBody, id_lists: list[list[int]], results: list[Generated]
    ) -> list[dict[str, Any]]:
        """The choices of every prompt, decoded (in a worker thread: `offload`)."""
        token_text = self.token_text(body.logprobs is not None, body.return_tokens_as_token_ids)
        return [
            completion_choice(
                p * body.n + c.index,
                c,
                self.settings.decode(c.token_ids),
                token_text,
                ids if body.return_token_ids else None,
            )
            for p, (ids, result) in enumerate(zip(id_lists, results, strict=True))
            for c in result.choices
        ]

    @route("POST", "/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        caller = await self.authorize(request)
        body = await self.body(request, ChatCompletionBody)
        caller.check_use(self.resolve_model(body.model), self.settings.base_model)
        messages = body.conversation()
        self.settings.limits.check_fanout(1, body.n)
        self.settings.limits.check_text(body.texts(messages))
        job = await offload(self.chat_job, body, messages)
        ids = job.prompt_ids
        result = await self.generate(job, caller)
        token_text = self.token_text(body.logprobs, body.return_tokens_as_token_ids)

        def choices() -> list[dict[str, Any]]:
            return [
                chat_choice(c, self.settings.decode(c.token_ids), token_text, body.return_token_ids)
                for c in result.choices
            ]

        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": await offload(choices),
            "usage": usage(len(ids), result.choices),
        }
        if body.return_token_ids:
            reply["prompt_token_ids"] = ids
        return FiniteJSONResponse(reply, headers=replica_header([result]))

    @route("GET", "/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        caller = await self.authorize(request)
        listed = all_or_raise(await self.backend.broadcast(ListAdapters()))
        self.gate.note_slots(slots_held(listed))
        now, base, max_model_len = int(time.time()), self.settings.base_model, self.settings.max_model_len

        def entry(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "spotrl",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
            }

        adapters: dict[str, dict] = {}
        for replica in listed:
            for a in replica.adapters:
                if not caller.may_use(a.name, base):  # a run sees its own adapters only
                    continue
                listing = adapters.setdefault(
                    a.name, {**entry(a.name, a.source, base), "replicas": 0, "sha256": a.sha256}
                )
                listing["replicas"] += 1
                if listing["sha256"] != a.sha256:  # replicas disagree (a reload under way): say so
                    listing["sha256"] = None
        data = [entry(base, base, None), *sorted(adapters.values(), key=lambda e: _version_key(e["id"]))]
        return {"object": "list", "data": data}

    @route("GET", "/health")
    async def health(self) -> dict[str, Any]:
        # Never behind the token: load balancers and `wait_healthy` probe it.
        live = [r for r in await self.backend.broadcast(Ping()) if not isinstance(r, BaseException)]
        if not live:
            raise ApiError(503, "no live replica")
        return {"status": "ok", "replicas": len(live)}

    @route("GET", "/server_info")
    async def server_info(self, request: Request, config_format: str = "text") -> dict[str, Any]:
        await self.authorize(request)
        if config_format not in ("text", "json"):
            raise ApiError(400, "config_format: expected text or json")
        info = await self.backend.server_info()
        return {
            "vllm_config": info if config_format == "json" else json.dumps(info),
            "spotrl": {
                "num_replicas": self.settings.num_replicas,
                "base_model": self.settings.base_model,
                "base_fingerprint": self.settings.base_fingerprint,
                "bucket_url": self.settings.bucket_url,
            },
        }

    @route("GET", "/router/stats")
    async def router_stats(self, request: Request) -> dict[str, Any]:
        """The router's counters, and under `runs` the fair share's per run (a run's token sees its own only)."""
        caller = await self.authorize(request)
        listed = await self.backend.broadcast(ListAdapters())
        # The router's counters are worth answering even when a replica cannot list its adapters right now.
        self.gate.note_slots(slots_held([r for r in listed if not isinstance(r, BaseException)]))
        fair = self.gate.stats()
        if not caller.admin:
            fair["runs"] = {name: s for name, s in fair["runs"].items() if name == tenant_of(caller)}
        return {**self.backend.router_stats(), "runs": fair}

    @route("GET", "/engine/stats")
    async def engine_stats(self, request: Request) -> dict[str, Any]:
        caller = await self.authorize(request)
        reports = all_or_raise(await self.backend.broadcast(ReportEngine()))
        base = self.settings.base_model
        replicas = [report.as_json() for report in reports]
        for stats in replicas:  # other runs' adapter names are theirs
            stats["adapters"] = [a for a in stats["adapters"] if caller.may_use(a, base)]
        return {"replicas": replicas}


class AdminRoutes(_Routes):
    """Calls that change the fleet, applied to every live replica or to none; always behind a set token,
    and never from a browser (`require_json`)."""

    ADMIN = True

    async def authorize(self, request: Request) -> Caller:
        caller = await super().authorize(request)
        require_json(request)
        return caller

    @route("POST", "/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> dict[str, Any]:
        caller = await self.authorize(request)
        body = await self.body(request, LoadAdapterBody)
        caller.check_owns(body.lora_name)
        if body.load_inplace:
            raise ApiError(400, "load_inplace: not supported; publish a new version under a new name")
        return await load_everywhere(self.backend, body.lora_name, body.lora_path)

    @route("POST", "/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> dict[str, Any]:
        caller = await self.authorize(request)
        body = await self.body(request, UnloadAdapterBody)
        caller.check_owns(body.lora_name)
        results = all_or_raise(await self.backend.broadcast(UnloadAdapter(body.lora_name)))
        return {
            "status": "ok",
            "lora_name": body.lora_name,
            "replicas": len(results),
            "unloaded": sum(r.unloaded for r in results),
        }

    @route("POST", "/pause")
    async def pause(self, request: Request, mode: str = "keep") -> dict[str, Any]:
        (await self.authorize(request)).check_admin("pausing the fleet")
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode: expected one of {', '.join(PAUSE_MODES)}")
        results = await self.backend.broadcast(Pause(mode))
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.backend.broadcast(Resume())  # nobody stays paused when the pause as a whole failed
            raise as_api_error(failures[0], f"pause failed on {len(failures)} of {len(results)} replicas, resumed")
        # Each replica resumes by itself after its lease (`VLLMReplica.pause`) unless /resume comes first.
        lease_s = min((r.lease_s for r in results if r.lease_s is not None), default=None)
        return {"status": "paused", "mode": mode, "replicas": len(results), "lease_s": lease_s}

    @route("POST", "/resume")
    async def resume(self, request: Request) -> dict[str, Any]:
        (await self.authorize(request)).check_admin("resuming the fleet")
        return {"status": "resumed", "replicas": len(all_or_raise(await self.backend.broadcast(Resume())))}

    @route("POST", "/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> dict[str, Any]:
        (await self.authorize(request)).check_admin("resetting the prefix cache")
        results = all_or_raise(await self.backend.broadcast(ResetPrefixCache()))
        return {"success": all(r.success for r in results), "replicas": len(results)}

    # ---- runs: the tenants of a shared fleet (`deployments.runs`) ---------------------------------

    @route("POST", "/v1/runs")
    async def register_run(self, request: Request) -> dict[str, Any]:
        (await self.authorize(request)).check_admin("registering a run")
        body = await self.body(request, RunBody)
        token = self.runs.register(body.name, body.weight, body.max_staleness, body.lora_rank)
        if self.records is not None:
            try:
                await offload(self.records.save, body.name, self.runs.registration(body.name).as_record())
            except Exception as e:  # unrecorded, it would be forgotten by the next ingress: not registered
                self.runs.remove(body.name)
                raise ApiError(503, f"run {body.name!r} could not be recorded in the bucket: {e}") from None
        log.info("fleet ingress: registered run %s (%d runs)", body.name, len(self.runs.names()))
        return {"name": body.name, "token": token, **self.run_terms(body.name)}

    @route("GET", "/v1/runs")
    async def list_runs(self, request: Request) -> dict[str, Any]:
        """Every run for the admin; a run's token sees only its own (which is how a driver learns whose it is)."""
        caller = await self.authorize(request)
        if caller.admin:
            return {"runs": self.runs.names()}
        return {"runs": [caller.run] if caller.run else []}

    @route("GET", "/v1/runs/{name}")
    async def run_info(self, request: Request, name: str) -> dict[str, Any]:
        """What a run joining the fleet needs to know: where to publish (its prefix of the fleet's bucket, the
        only place the fleet loads its adapters from) and how long it may stay silent."""
        caller = await self.authorize(request)
        if not caller.admin and caller.run != name:
            raise ApiError(403, f"run {name[:64]!r}: a run's token may see only its own run")
        if name not in self.runs.names():
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        return {
            "name": name,
            "bucket_url": redact(run_prefix(self.records.url, name)) if self.records is not None else None,
            "idle_timeout_s": self.runs.idle_timeout_s,
            **self.run_terms(name),
        }

    def run_terms(self, name: str) -> dict[str, Any]:
        """What run `name` registered with, as the fleet applies it: weight, staleness window, LoRA rank."""
        return {
            "weight": self.runs.weight(name),
            "max_staleness": self.runs.window(name) - 1,
            "lora_rank": self.runs.registration(name).lora_rank,
        }

    @route("DELETE", "/v1/runs/{name}")
    async def remove_run(self, request: Request, name: str) -> dict[str, Any]:
        """Forget the run (its token stops working at once) and unload its adapters everywhere."""
        (await self.authorize(request)).check_admin("removing a run")
        if name not in self.runs.names():
            raise ApiError(404, f"run {name[:64]!r} is not registered")
        if self.records is not None:  # first: a record left behind would bring the run back after a restart
            try:
                await offload(self.records.delete, name)
            except Exception as e:
                raise ApiError(
                    503, f"run {name!r} could not be removed from the bucket, still registered: {e}"
                ) from None
        self.runs.remove(name)
        names = await unload_run(self.backend, name)
        log.info("fleet ingress: removed run %s, unloaded %s", name, names or "nothing")
        return {"status": "removed", "name": name, "unloaded": names}

    @route("POST", "/v1/runs/{name}/heartbeat")
    async def run_heartbeat(self, request: Request, name: str) -> dict[str, Any]:
        """A run that is alive but sends nothing else for a while (a long learner step) says so here."""
        caller = await self.authorize(request)
        if not caller.admin and caller.run != name:
            raise ApiError(403, f"run {name[:64]!r}: a run's token keeps only its own run alive")
        self.runs.heartbeat(name)
        return {"name": name, "idle_timeout_s": self.runs.idle_timeout_s}


def require_json(request: Request) -> None:
    """415 unless the request declares a JSON body, or has no body, no Content-Type and no `Origin`
    (what `requests` and `httpx` send for a body-less POST; a browser always adds `Origin`)."""
    content_type = request.headers.get("content-type")
    if content_type is None and not has_body(request) and "origin" not in request.headers:
        return
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "admin calls take Content-Type: application/json")


def has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return "transfer-encoding" in request.headers or (length is not None and length.strip() != "0")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes: by its Content-Length without
    waiting for a byte, else (chunked, or a Content-Length that lies) while it streams in."""
    too_large = ApiError(413, f"body: larger than the limit of {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, "content-length: not a number")
        if len(declared) > 18 or int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def load_everywhere(backend: Backend, name: str, path: str) -> dict[str, Any]:
    """Load adapter `name` from `path` on every live replica or on none (`ApiError` then says why).

    `/v1/load_lora_adapter` and the ingress's in-cluster `load_adapter` (a Serve handle call) both
    come here. The broadcast and its rollback run shielded from the caller: a client that gives up
    (an HTTP disconnect, a handle call past its deadline) cancels its wait, never a half-done load.
    """
    return await asyncio.shield(_load_all_or_nothing(backend, name, path))


async def _load_all_or_nothing(backend: Backend, name: str, path: str) -> dict[str, Any]:
    load_id = uuid.uuid4().hex
    results = await backend.broadcast(LoadAdapter(name, path, load_id))
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures or not results:
        # All or nothing: undo the loads this broadcast made, so no replica serves what others cannot.
        await backend.broadcast(UndoLoad(name, load_id))
        # A client pauses, loads, resumes (TRL does): one whose load failed raises before its resume, and
        # the fleet, everyone's, would stay paused until its pause lease ran out.
        await backend.broadcast(Resume())
        if not results:
            raise ApiError(503, "no live replica")
        raise as_api_error(
            failures[0], f"load of {name!r} failed on {len(failures)} of {len(results)} replicas, rolled back"
        )
    return {
        "status": "ok",
        "lora_name": name,
        "replicas": len(results),
        "newly_loaded": sum(r.loaded for r in results),
    }


async def unload_run(backend: Backend, run: str) -> list[str]:
    """Unload every adapter of `run` (`<run>/...`) from every live replica; returns their names."""
    listed = all_or_raise(await backend.broadcast(ListAdapters()))
    names = sorted({a.name for r in listed for a in r.adapters if split_run(a.name)[0] == run})
    for adapter in names:
        all_or_raise(await backend.broadcast(UnloadAdapter(adapter)))
    return names


def tenant_of(caller: Caller) -> str:
    """Whose share a caller's generations count against: its run's, or the admin's and anonymous callers' one."""
    return caller.run or FLEET_TENANT


def slots_held(listed: list[AdapterListing]) -> dict[str, int]:
    """LoRA slots per run (un-namespaced adapters: `FLEET_TENANT`) on the fullest engine, from `list_adapters`."""
    held: dict[str, int] = {}
    for replica in listed:
        counts: dict[str, int] = {}
        for a in replica.adapters:
            owner = split_run(a.name)[0] or FLEET_TENANT
            counts[owner] = counts.get(owner, 0) + 1
        for owner, n in counts.items():
            held[owner] = max(held.get(owner, 0), n)
    return held


def all_or_raise(results: list[Any]) -> list[Any]:
    """The replies of a broadcast, raising the first failure (a broadcast that partly failed is an error)."""
    for r in results:
        if isinstance(r, BaseException):
            raise as_api_error(r, "a replica failed")
    return results


def as_api_error(exc: BaseException, context: str) -> ApiError:
    """A replica's error with its own status (`ReplicaError`, also when Ray wraps it), else a 500 naming the type."""
    cause = getattr(exc, "cause", None) or exc
    status = getattr(cause, "status", None)
    if isinstance(status, int) and 400 <= status < 600:
        return ApiError(status, f"{context}: {getattr(cause, 'message', cause)}")
    return ApiError(500, f"{context}: {type(cause).__name__}")


def replica_header(results: list[Generated]) -> dict[str, str]:
    return {"x-spotrl-replica": ",".join(dict.fromkeys(r.replica for r in results))}


def _version_key(name: str) -> tuple[int, str]:
    stem, _, number = name.rpartition("-v")
    return (int(number), stem) if number.isdigit() else (-1, name)
