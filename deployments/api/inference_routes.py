"""OpenAI's inference routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and vLLM's `/tokenize` and
`/inference/v1/generate`.

They speak what TRL's AsyncGRPOTrainer (`trl.experimental.async_grpo`) and the `openai` client send:
token-id or text prompts, `return_token_ids` and `logprobs`; and what a teacher is asked (TRL's
AsyncDistillationTrainer, spotrl's distill objective): `prompt_logprobs` with `max_tokens: 1` scores a
token-id sequence, and `/tokenize` lets a client compare tokenizers; and what verifiers' `TrainClient` sends (vLLM's
`/inference/v1/generate`: rendered token ids in, token ids and sampling log-probs out, a rollout's turns on one replica
by its `X-Session-ID`). Open to anyone unless `protect_inference` puts
them behind the token; a run's token reaches the base model and its own adapters only (`Caller`). Each
generation waits for places in the fleet, one per sequence (`deployments.control.fair_share`; a batch of prompts is
one generation per prompt, prompts x n places in all), then goes to the backend; like generations of one run that
arrive together (a group sent one sample per request) go as one, and its scored sequences that route alike go in one
replica call (`deployments.control.coalesce`);
tokenizing and decoding run in worker threads (`offload`), never on the event loop, except work smaller than the trip to
a thread (a few hundred token ids to check or answer: `offload_unless_small`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from contracts.control import ListAdapters
from contracts.serving import Generated, GenerateRequest
from deployments.api.bodies import ChatCompletionBody, CompletionBody, TokenGenerateBody, TokenizeBody, session_id
from deployments.api.callers import Caller, Callers
from deployments.api.intake import read_json
from deployments.api.prompts import Prompts
from deployments.api.replies import (
    FiniteJSONResponse,
    TokenText,
    cached_token_text,
    chat_choice,
    choice_text,
    completion_choice,
    replica_header,
    token_choice,
    token_id_placeholder,
    usage,
)
from deployments.api.routing import Routes, route
from deployments.api.settings import ApiSettings
from deployments.control.backend import Backend
from deployments.control.broadcast import everywhere
from deployments.control.coalesce import Coalescer, Generations, Merged
from deployments.control.errors import as_api_error
from deployments.control.fair_share import FairShare
from deployments.control.offload import INLINE_TOKENS, offload, offload_unless_small

log = logging.getLogger("ray.serve")


class InferenceRoutes(Routes):
    def __init__(
        self,
        settings: ApiSettings,
        callers: Callers,
        backend: Backend,
        gate: FairShare,
        scrub: Callable[[str], str],
    ):
        self.settings, self.callers, self.backend, self.gate, self.scrub = settings, callers, backend, gate, scrub
        self.prompts = Prompts(settings)
        self._token_text = cached_token_text(settings.decode)
        # Like requests of one run sent together share one engine call (`deployments.control.coalesce`).
        self.coalescer: Coalescer[GenerateRequest, Generated] = Coalescer(
            settings.coalesce_window_s,
            max_n=settings.limits.max_sequences_per_request,
            kind=Generations(settings.routing_block_size),
        )

    async def generate(self, request: GenerateRequest, caller: Caller) -> Generated:
        """One generation, merged or bundled with like ones of the same run sent at the same moment (`Coalescer`)."""
        return await self.coalescer.generate(caller.tenant, request, lambda call: self._call(call, caller))

    async def _call(self, call: list[Merged], caller: Caller) -> list[Generated | Exception]:
        """One replica call for the caller's run (one request, or a bundle of them), once the run has places in the
        fleet for all its sequences (`deployments.control.fair_share`): each one's answer or API error. The run's
        usage counts what its clients sent, each request and its prompt, as the usage each reply reports: merging
        them is the fleet's saving, not the run's."""
        places = sum(m.request.sampling.n for m in call)
        try:
            async with self.gate.slot(caller.tenant, places, sum(m.callers for m in call)) as used:
                if len(call) == 1:
                    answers: list[Generated | Exception] = [await self.backend.generate(call[0].request)]
                else:
                    answers = await self.backend.generate_many([m.request for m in call])
                used.prompt_tokens = sum(len(m.request.prompt_ids) * m.callers for m in call)
                used.completion_tokens = sum(
                    len(c.token_ids) for a in answers if isinstance(a, Generated) for c in a.choices
                )
        except Exception as e:
            raise self._api_error(e) from None
        return [a if isinstance(a, Generated) else self._api_error(a) for a in answers]

    def _api_error(self, failure: Exception) -> Exception:
        """A ReplicaError keeps its status (404 unknown model, 400, 503); others are 500, logged."""
        api_error = as_api_error(failure, "generation failed")
        if api_error.status >= 500:
            log.error("fleet ingress: generation failed: %s", self.scrub(repr(failure))[:2000])
        return api_error

    def check_use(self, caller: Caller, model: str) -> None:
        """The base model and the teacher deployments are everyone's; an adapter its owner's (`Caller`)."""
        resolved = self.prompts.resolve_model(model)
        if resolved not in self.settings.deployed_models:
            caller.check_use(resolved, self.settings.base_model)

    def token_text(self, asked: bool, as_ids: bool | None) -> TokenText | None:
        """How log-prob listings name tokens: not at all unless `asked`; by id alone if the client said so."""
        if not asked:
            return None
        return token_id_placeholder if as_ids else self._token_text

    @route("POST", "/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        caller = self.callers.authorize(request)
        body = await read_json(request, CompletionBody, self.settings.limits)
        self.check_use(caller, body.model)
        prompts = body.prompts()
        limits = self.settings.limits
        limits.check_fanout(len(prompts), body.n)
        limits.check_text(p for p in prompts if isinstance(p, str))
        # Token ids to check are small work, text to tokenize is not (`offload_unless_small`).
        few_ids = not any(isinstance(p, str) for p in prompts) and sum(map(len, prompts)) <= INLINE_TOKENS
        jobs = await offload_unless_small(few_ids, self.prompts.completion_jobs, body, prompts)
        id_lists = [job.prompt_ids for job in jobs]
        limits.check_prompt_logprobs(sum(map(len, id_lists)), body.prompt_logprobs, body.n)
        results = await asyncio.gather(*(self.generate(job, caller) for job in jobs))
        tokens = sum(map(len, id_lists)) * (body.prompt_logprobs is not None) + sum(
            len(c.token_ids) for r in results for c in r.choices
        )
        choices = await offload_unless_small(tokens <= INLINE_TOKENS, self.completion_choices, body, id_lists, results)
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
        prompt_token_text = self.token_text(True, body.return_tokens_as_token_ids)
        return [
            completion_choice(
                p * body.n + c.index,
                c,
                choice_text(c, self.settings.decode),
                token_text,
                ids if body.return_token_ids else None,
                prompt_token_text,
            )
            for p, (ids, result) in enumerate(zip(id_lists, results, strict=True))
            for c in result.choices
        ]

    @route("POST", "/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        caller = self.callers.authorize(request)
        body = await read_json(request, ChatCompletionBody, self.settings.limits)
        self.check_use(caller, body.model)
        messages = body.conversation()
        self.settings.limits.check_fanout(1, body.n)
        self.settings.limits.check_text(body.texts(messages))
        job = await offload(self.prompts.chat_job, body, messages)
        ids = job.prompt_ids
        result = await self.generate(job, caller)
        token_text = self.token_text(body.logprobs, body.return_tokens_as_token_ids)

        def choices() -> list[dict[str, Any]]:
            return [
                chat_choice(c, choice_text(c, self.settings.decode), token_text, body.return_token_ids)
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

    @route("POST", "/inference/v1/generate")
    async def generate_tokens(self, request: Request) -> JSONResponse:
        """vLLM's tokens-in, tokens-out route (`output_mode` "tokens"), as verifiers' `TrainClient` calls it."""
        caller = self.callers.authorize(request)
        body = await read_json(request, TokenGenerateBody, self.settings.limits)
        body.refuse_unsupported()
        session = session_id(request.headers)
        model = body.model or self.settings.base_model
        self.check_use(caller, model)
        self.settings.limits.check_fanout(1, body.sampling_params.n)
        job = await offload_unless_small(len(body.token_ids) <= INLINE_TOKENS, self.prompts.token_job, body, session)
        result = await self.generate(job, caller)
        with_logprobs = job.sampling.logprobs is not None
        reply = {
            "request_id": body.request_id or uuid.uuid4().hex,
            "output_mode": "tokens",
            "model": model,
            "created": int(time.time()),
            "choices": [token_choice(c, with_logprobs) for c in result.choices],
            "usage": usage(len(job.prompt_ids), result.choices),
            "prompt_token_ids": job.prompt_ids if body.return_token_ids else None,
        }
        return FiniteJSONResponse(reply, headers=replica_header([result]))

    @route("POST", "/tokenize")
    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's `/tokenize`: how the fleet tokenizes a text (every model it serves shares the one tokenizer)."""
        caller = self.callers.authorize(request)
        body = await read_json(request, TokenizeBody, self.settings.limits)
        self.check_use(caller, body.model)
        self.settings.limits.check_text([body.prompt])
        ids = await offload(self.settings.encode, body.prompt)
        return {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids, "token_strs": None}

    @route("GET", "/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        caller = self.callers.authorize(request)
        listed = await everywhere(self.backend, ListAdapters())
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
        deployed = [entry(name, name, None) for name in sorted(self.settings.deployed_models)]
        data = [entry(base, base, None), *deployed, *sorted(adapters.values(), key=lambda e: _version_key(e["id"]))]
        return {"object": "list", "data": data}


def _version_key(name: str) -> tuple[int, str]:
    stem, _, number = name.rpartition("-v")
    return (int(number), stem) if number.isdigit() else (-1, name)
