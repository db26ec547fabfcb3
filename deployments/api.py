"""The fleet's HTTP API as a plain FastAPI app: OpenAI-compatible inference plus vLLM's admin calls.

It speaks what TRL's AsyncGRPOTrainer (`trl.experimental.async_grpo`) and the `openai` client send:
`/v1/completions` with token-id prompts, `return_token_ids` and `logprobs`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/server_info`, and the admin calls `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/pause`, `/resume`, `/reset_prefix_cache`, each applied to every replica.

Prompts are tokenized here, never by vLLM, with the tokenizer that was checked to round-trip, and
generated tokens are decoded here: what the learner later scores is exactly what was sampled. The
app is independent of Ray (a `Backend` does the generating and broadcasting), so its parsing, auth
and error handling are unit-tested with a fake backend; `deployments.ingress` plugs in Ray Serve.

Errors: a malformed request gets 400 with the reason, an unknown model 404, a missing or wrong
token 401; messages never carry the token, and the bucket's `redact` strips credentials from URLs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from app.auth import redact, token_matches

log = logging.getLogger("ray.serve")

# How /pause treats in-flight requests (vLLM's modes). `keep` freezes them until /resume: nothing is lost.
PAUSE_MODES = ("keep", "wait", "abort")


class ApiError(Exception):
    """Answered as `{"error": {...}}` with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "server_error"
        )


class Backend(Protocol):
    """What the app needs from the fleet (Ray Serve in production, a fake in unit tests)."""

    async def generate(self, prompt_ids: list[int], model: str, sampling: dict[str, Any]) -> dict[str, Any]: ...

    async def broadcast(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every live replica; one result or exception per replica."""
        ...

    async def server_info(self) -> dict[str, Any]: ...

    def router_stats(self) -> dict[str, Any]: ...


@dataclass
class ApiSettings:
    """What the ingress knows about the model it fronts."""

    base_model: str  # the `model` name meaning "no adapter" (listed first by /v1/models)
    model_aliases: frozenset[str]  # other names accepted for the base model (e.g. "tiny", the folder path)
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    chat_ids: Callable[[list[dict[str, Any]], bool], list[int]]
    admin_token: str | None = None
    protect_inference: bool = False
    num_replicas: int = 1


# ---- request bodies ------------------------------------------------------------------------------

TokenIds = list[StrictInt]


class _Sampling(BaseModel):
    """Sampling fields shared by completions and chat completions (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="ignore")  # like vLLM: unknown OpenAI fields (user, ...) are ignored

    model: str = Field(min_length=1, max_length=4096)
    n: int = Field(1, ge=1, le=256)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    stream: bool = False

    def sampling(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        if self.stream:
            raise ApiError(400, "stream: streaming responses are not supported")
        if self.stop:
            raise ApiError(
                400, "stop: stop strings are not supported (the engine never detokenizes); use stop_token_ids"
            )
        return {
            "n": self.n,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p,
            "seed": self.seed,
            "logprobs": logprobs,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
        }


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=128)


# ---- the app -------------------------------------------------------------------------------------


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


def make_app(backend: Backend, settings: ApiSettings) -> FastAPI:
    """The FastAPI app of the fleet, over any `Backend`."""
    app = FastAPI(title="spotrl fleet", docs_url=None, redoc_url=None, openapi_url=None)
    token = settings.admin_token

    def scrub(message: str) -> str:
        message = redact(message)
        return message.replace(token, "***") if token else message

    def error(status: int, message: str, kind: str | None = None) -> JSONResponse:
        exc = ApiError(status, scrub(message), kind)
        headers = {"WWW-Authenticate": 'Bearer realm="spotrl", Basic realm="spotrl"'} if status == 401 else None
        return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "code": status}}, status, headers)

    def authorize(request: Request, admin: bool) -> None:
        if token and (admin or settings.protect_inference):
            if not token_matches(request.headers.get("authorization"), token):
                raise ApiError(401, "missing or invalid token (send Authorization: Bearer <token>, or Basic auth)")

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "body: not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body: expected a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise ApiError(400, _first_error(e)) from None

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error(exc.status, exc.message, exc.kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A FleetError from a replica keeps its status; anything else is a 500 that names only the type.
        api_error = _as_api_error(exc, "request failed")
        if api_error.status >= 500:
            log.error("fleet ingress: %s on %s: %s", type(exc).__name__, request.url.path, scrub(repr(exc))[:2000])
        return error(api_error.status, api_error.message)

    async def generate(ids: list[int], model: str, sampling: dict[str, Any]) -> dict[str, Any]:
        try:
            return await backend.generate(ids, model, sampling)
        except Exception as e:  # a FleetError keeps its status (404 unknown model, 400, 503); others are 500
            api_error = _as_api_error(e, "generation failed")
            if api_error.status >= 500:
                log.error("fleet ingress: generation failed: %s", scrub(repr(e))[:2000])
            raise api_error from None

    def resolve_model(name: str) -> str:
        return settings.base_model if name in settings.model_aliases or name == settings.base_model else name

    def check_prompt(ids: list[int], max_tokens: int | None) -> int:
        if not ids:
            raise ApiError(400, "prompt: empty")
        bad = next((t for t in ids if not 0 <= t < settings.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (0..{settings.vocab_size - 1})")
        room = settings.max_model_len - len(ids)
        if room < 1:
            raise ApiError(
                400, f"prompt: {len(ids)} tokens leave no room within max_model_len {settings.max_model_len}"
            )
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens: {max_tokens} + {len(ids)} prompt tokens exceed max_model_len {settings.max_model_len}",
            )
        return max_tokens if max_tokens is not None else room

    def usage(prompt_tokens: int, choices: list[dict]) -> dict[str, int]:
        completion = sum(len(c["token_ids"]) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def replica_header(results: list[dict]) -> dict[str, str]:
        return {"x-spotrl-replica": ",".join(dict.fromkeys(r["replica"] for r in results))}

    # ---- inference --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request, admin=False)
        req: CompletionRequest = await body_of(request, CompletionRequest)
        if req.echo or (req.best_of or 1) > 1:
            raise ApiError(400, "echo and best_of are not supported")
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) or not prompts:
            prompts = [prompts]
        id_lists = [settings.encode(p) if isinstance(p, str) else p for p in prompts]
        model = resolve_model(req.model)
        jobs = []
        for ids in id_lists:
            max_tokens = check_prompt(ids, req.max_tokens)
            jobs.append((ids, req.sampling(max_tokens, req.logprobs)))
        results = await asyncio.gather(*(generate(ids, model, sampling) for ids, sampling in jobs))
        choices, prompt_tokens = [], 0
        for p, (ids, result) in enumerate(zip(id_lists, results, strict=True)):
            prompt_tokens += len(ids)
            for c in result["choices"]:
                choice = {
                    "index": p * req.n + c["index"],
                    "text": settings.decode(c["token_ids"]),
                    "logprobs": None,
                    "finish_reason": c["finish_reason"],
                    "stop_reason": c["stop_reason"],
                    "token_ids": None,
                    "prompt_token_ids": None,
                }
                if req.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(c, settings.decode)
                if req.return_token_ids:
                    choice["token_ids"], choice["prompt_token_ids"] = c["token_ids"], ids
                choices.append(choice)
        raw_choices = [c for r in results for c in r["choices"]]
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": usage(prompt_tokens, raw_choices),
        }
        return JSONResponse(body, headers=replica_header(results))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request, admin=False)
        req: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = settings.chat_ids(messages, req.add_generation_prompt)
        except ApiError:
            raise
        except Exception as e:  # the chat template rejected the conversation
            raise ApiError(400, f"messages: cannot apply the chat template ({type(e).__name__}: {e})") from None
        max_tokens = check_prompt(ids, req.max_completion_tokens or req.max_tokens)
        top = (req.top_logprobs or 0) if req.logprobs else None
        result = await generate(ids, resolve_model(req.model), req.sampling(max_tokens, top))
        choices = []
        for c in result["choices"]:
            choice = {
                "index": c["index"],
                "message": {"role": "assistant", "content": settings.decode(c["token_ids"])},
                "logprobs": None,
                "finish_reason": c["finish_reason"],
                "stop_reason": c["stop_reason"],
            }
            if req.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(c, settings.decode)}
            if req.return_token_ids:
                choice["token_ids"] = c["token_ids"]
            choices.append(choice)
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": usage(len(ids), result["choices"]),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body, headers=replica_header([result]))

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request, admin=False)
        listed = _ok(await backend.broadcast("list_adapters"))
        now = int(time.time())
        data = [
            {
                "id": settings.base_model,
                "object": "model",
                "created": now,
                "owned_by": "spotrl",
                "root": settings.base_model,
                "parent": None,
                "max_model_len": settings.max_model_len,
            }
        ]
        seen: dict[str, dict] = {}
        for replica in listed:
            for a in replica["adapters"]:
                entry = seen.setdefault(
                    a["name"],
                    {
                        "id": a["name"],
                        "object": "model",
                        "created": now,
                        "owned_by": "spotrl",
                        "root": a["source"],
                        "parent": settings.base_model,
                        "max_model_len": settings.max_model_len,
                        "replicas": 0,
                    },
                )
                entry["replicas"] += 1
        data += sorted(seen.values(), key=lambda e: _version_key(e["id"]))
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        live = [r for r in await backend.broadcast("ping") if not isinstance(r, BaseException)]
        if not live:
            raise ApiError(503, "no live replica")
        return {"status": "ok", "replicas": len(live)}

    @app.get("/server_info")
    async def server_info(request: Request, config_format: str = "text"):
        authorize(request, admin=False)
        if config_format not in ("text", "json"):
            raise ApiError(400, "config_format: expected text or json")
        info = await backend.server_info()
        return {
            "vllm_config": info if config_format == "json" else json.dumps(info),
            "spotrl": {"num_replicas": settings.num_replicas, "base_model": settings.base_model},
        }

    @app.get("/router/stats")
    async def stats_of_router(request: Request):
        authorize(request, admin=False)
        return backend.router_stats()

    @app.get("/engine/stats")
    async def stats_of_engines(request: Request):
        authorize(request, admin=False)
        return {"replicas": _ok(await backend.broadcast("engine_stats"))}

    # ---- admin: every replica or none ---------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        authorize(request, admin=True)
        req: LoadAdapterRequest = await body_of(request, LoadAdapterRequest)
        if req.load_inplace:
            raise ApiError(400, "load_inplace: not supported; publish a new version under a new name")
        load_id = uuid.uuid4().hex
        results = await backend.broadcast("load_adapter", req.lora_name, req.lora_path, load_id)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures or not results:
            # All or nothing: undo the loads this broadcast made, so no replica serves what others cannot.
            await backend.broadcast("undo_load", req.lora_name, load_id)
            if not results:
                raise ApiError(503, "no live replica")
            raise _as_api_error(
                failures[0],
                f"load of {req.lora_name!r} failed on {len(failures)} of {len(results)} replicas, rolled back",
            )
        return {
            "status": "ok",
            "lora_name": req.lora_name,
            "replicas": len(results),
            "newly_loaded": sum(bool(r["loaded"]) for r in results),
        }

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        authorize(request, admin=True)
        req: UnloadAdapterRequest = await body_of(request, UnloadAdapterRequest)
        results = _ok(await backend.broadcast("unload_adapter", req.lora_name))
        return {
            "status": "ok",
            "lora_name": req.lora_name,
            "replicas": len(results),
            "unloaded": sum(bool(r["unloaded"]) for r in results),
        }

    @app.post("/pause")
    async def pause(request: Request, mode: str = "keep"):
        authorize(request, admin=True)
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode: expected one of {', '.join(PAUSE_MODES)}")
        results = await backend.broadcast("pause", mode)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await backend.broadcast("resume")  # nobody stays paused when the pause as a whole failed
            raise _as_api_error(failures[0], f"pause failed on {len(failures)} of {len(results)} replicas, resumed")
        return {"status": "paused", "mode": mode, "replicas": len(results)}

    @app.post("/resume")
    async def resume(request: Request):
        authorize(request, admin=True)
        return {"status": "resumed", "replicas": len(_ok(await backend.broadcast("resume")))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        authorize(request, admin=True)
        results = _ok(await backend.broadcast("reset_prefix_cache"))
        return {"success": all(r["success"] for r in results), "replicas": len(results)}

    return app


def _ok(results: list[Any]) -> list[Any]:
    """The replies of a broadcast, raising the first failure (a broadcast that partly failed is an error)."""
    for r in results:
        if isinstance(r, BaseException):
            raise _as_api_error(r, "a replica failed")
    return results


def _as_api_error(exc: BaseException, context: str) -> ApiError:
    cause = getattr(exc, "cause", None) or exc
    status = getattr(cause, "status", None)
    if isinstance(status, int) and 400 <= status < 600:
        return ApiError(status, f"{context}: {getattr(cause, 'message', cause)}")
    return ApiError(500, f"{context}: {type(cause).__name__}")


def _version_key(name: str) -> tuple[int, str]:
    stem, _, number = name.rpartition("-v")
    return (int(number), stem) if number.isdigit() else (-1, name)


def _completion_logprobs(choice: dict, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """OpenAI's legacy completions log-probs: per-token strings, log-probs, offsets, top alternatives."""
    tokens = [decode([t]) for t in choice["token_ids"]]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = choice.get("top_logprobs")
    return {
        "tokens": tokens,
        "token_logprobs": choice["logprobs"] or [],
        "text_offset": offsets,
        "top_logprobs": [{decode([t]): lp for t, lp in alt.items()} for alt in top] if top else None,
    }


def _chat_logprobs(choice: dict, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    top = choice.get("top_logprobs") or [{}] * len(choice["token_ids"])
    out = []
    for token, lp, alt in zip(choice["token_ids"], choice["logprobs"] or [], top, strict=False):
        text = decode([token])
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": decode([t]), "logprob": v, "bytes": list(decode([t]).encode())} for t, v in alt.items()
                ],
            }
        )
    return out
