"""The sampling client's routes: a sampler of the base model, of the key's sampler weights or of another key's
published ones (a copy under the key's own lineage: the fleet serves a key its own lineage only), and its samples,
asked of the fleet in the key's own lane (`FleetCalls`) and accepted at once as a future."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from tinker import types

from contracts.adapters import adapter_name
from deployments.api.routing import route
from deployments.control.errors import ApiError
from deployments.tinker.fleet_calls import FleetRefused, Tenant
from deployments.tinker.futures import RequestFailed, Result
from deployments.tinker.http import accepted, as_json
from deployments.tinker.limits import Refused
from deployments.tinker.paths import owner_key, parsed
from deployments.tinker.routes import Parts, TinkerRoutes
from deployments.tinker.wire import Sequence, encode_sample_response


class SamplingRoutes(TinkerRoutes):
    def __init__(self, parts: Parts):
        super().__init__(parts)
        self.adopted: dict[tuple[str, str, int], int] = {}  # (run, published path, its version) -> the run's copy

    def forget(self, run: str) -> None:
        """Run `run` is gone: its copies of published weights are forgotten."""
        self.adopted = {key: copy for key, copy in self.adopted.items() if key[0] != run}

    @route("POST", "/v1/create_sampling_session")
    async def create_sampling_session(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.CreateSamplingSessionRequest)
        self.callers.session(body.session_id, tenant)
        if body.model_path:
            parsed(body.model_path)
            found = await self.paths.recall(tenant, body.model_path, "sampler")
            if found is None:
                raise ApiError(
                    404, f"model_path {body.model_path[:200]!r}: no sampler weights of this API key, nor published ones"
                )
            version = found[0] if found[1] is None else await self._adopted(tenant, body.model_path, *found)
            fleet_model = adapter_name(version, tenant.run)
            sampler = self.sessions.add_sampler(
                tenant.run, body.session_id, fleet_model, self.settings.base_model, body.model_path
            )
        else:
            base = self.callers.base(body.base_model)
            sampler = self.sessions.add_sampler(tenant.run, body.session_id, base, base, None)
        return as_json(types.CreateSamplingSessionResponse(sampling_session_id=sampler.sampler_id))

    async def _adopted(self, tenant: Tenant, path: str, version: int, source: str) -> int:
        """This tenant's copy of another tenant's published sampler weights (`TinkerLearner.adopt`), loaded on the
        fleet: the fleet serves a tenant its own lineage only. One copy per published version and tenant."""
        key = (tenant.run, path, version)
        if key not in self.adopted:
            try:
                lineage = await self.callers.lineage(tenant)
                # The original must verify under its owner's key: the copy is signed anew, with this tenant's.
                source_key = owner_key(self.admin_token, source)
                copy = await self.recovery.run_on(
                    0, lambda learner: learner.adopt(lineage, source, version, source_key)
                )
                await self.fleet.load_adapter(tenant, adapter_name(copy.version, tenant.run), copy.key)
            except (RequestFailed, FleetRefused) as failed:
                raise ApiError(503, f"{path[:200]}: the published weights could not be copied: {failed}") from None
            self.adopted[key] = copy.version
        return self.adopted[key]

    @route("GET", "/v1/samplers/{sampler_id}")
    async def get_sampler(self, request: Request, sampler_id: str) -> dict:
        tenant = await self.callers.tenant(request)
        sampler = self.callers.sampler(sampler_id, tenant)
        reply = types.GetSamplerResponse(
            sampler_id=sampler.sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
        )
        return as_json(reply)

    @route("POST", "/v1/asample")
    async def asample(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise ApiError(400, "SampleRequest: sampling_session_id is required here")
        sampler = self.callers.sampler(body.sampling_session_id, tenant)
        try:
            prompt = body.prompt.to_ints()
        except Exception as exc:  # noqa: BLE001 - an image chunk, say
            raise ApiError(400, f"prompt: only token chunks are supported ({exc})") from None
        try:
            self.limits.sample(body, prompt)
        except Refused as exc:
            raise ApiError(400, str(exc)) from None
        fleet_body = completion_body(body, sampler.fleet_model, prompt)

        async def work() -> Result:
            try:
                answer = await self.fleet.completions(tenant, fleet_body)
            except FleetRefused as refused:
                category = "user" if 400 <= refused.status < 500 and refused.status != 429 else "server"
                raise RequestFailed(f"the fleet refused the sample: {refused.message}", category) from None
            return Result(proto=sample_response(body, prompt, answer))

        sequence_ids = [f"{uuid.uuid4().hex}" for _ in range(body.num_samples)]
        return accepted(self.futures.submit(tenant.run, work()), sample_sequence_ids=sequence_ids)


def completion_body(body: types.SampleRequest, fleet_model: str, prompt: list[int]) -> dict[str, Any]:
    """The fleet's completions request (vLLM's fields) for a `SampleRequest` of `prompt` from `fleet_model`."""
    params = body.sampling_params
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    strings = bool(stop) and isinstance(next(iter(stop)), str)
    fleet_body: dict[str, Any] = {
        "model": fleet_model,
        "prompt": prompt,
        "n": body.num_samples,
        "max_tokens": params.max_tokens or 16,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if params.seed is not None:
        fleet_body["seed"] = params.seed
    if strings:  # the fleet stops at them as vLLM does: the sequence's tokens end with the one completing it
        fleet_body["stop"] = list(stop)
    elif stop is not None:
        fleet_body["stop_token_ids"] = list(stop)
        if not stop:
            fleet_body["ignore_eos"] = True
    if body.prompt_logprobs:
        fleet_body["prompt_logprobs"] = 0
    return fleet_body


def sample_response(body: types.SampleRequest, prompt: list[int], answer: dict[str, Any]) -> bytes:
    """The fleet's completions answer as the SDK's `SampleResponse` (protobuf)."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    sequences = [
        Sequence(
            list(c.get("token_ids") or []),
            list((c.get("logprobs") or {}).get("token_logprobs") or []),
            c.get("finish_reason") or "length",
        )
        for c in choices
    ]
    prompt_logprobs = None
    if body.prompt_logprobs and choices:
        listed = choices[0].get("prompt_logprobs") or []
        prompt_logprobs = [
            None if entry is None else entry[str(token)]["logprob"]
            for token, entry in zip(prompt, listed, strict=False)
        ]
        if body.prompt_logprobs_last_n is not None:  # only the last N are asked for; the rest read None
            unasked = len(prompt_logprobs) - body.prompt_logprobs_last_n
            prompt_logprobs = [None] * unasked + prompt_logprobs[unasked:]
    return encode_sample_response(sequences, prompt_logprobs)
