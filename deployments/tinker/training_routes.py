"""The training client's routes: create one, train it (`forward_backward`, `optim_step`), save it (a state, sampler
weights, an export) and load a state, each accepted at once as a future and run in its `seq_id`'s turn.

A route's learner call reads as the learner method it reaches: `forward_backward` awaits
`recovery.run(model, tenant, lambda learner: learner.forward_backward(call))`, which calls
`contracts.tinker.TinkerBackend.forward_backward` (`RayLearner`), which runs `TinkerLearner.forward_backward` in the
learner actor. The learner answers numbers; the tinker path the user is given for one is recorded here
(`TenantPaths.remember`).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request
from tinker import types

from contracts.adapters import adapter_name
from contracts.tinker import AdamStep, AdapterSpec
from core.bucket.tinker_paths import own_record
from deployments.api.routing import route
from deployments.control.errors import ApiError
from deployments.control.offload import offload
from deployments.tinker.fleet_calls import FleetRefused
from deployments.tinker.futures import RequestFailed, Result
from deployments.tinker.http import accepted, as_json
from deployments.tinker.limits import Refused
from deployments.tinker.paths import checkpoint_path, expiry, user_metadata
from deployments.tinker.routes import TinkerRoutes
from deployments.tinker.sessions import NotFound, OverCapacity
from deployments.tinker.wire import WireError, encode_forward_backward_output, parse_forward_backward


class TrainingRoutes(TinkerRoutes):
    def _reserve(self, session_id: str, tenant: str, seq: int, base: str, rank: int):
        try:
            return self.sessions.reserve_model(session_id, tenant, seq, base, rank)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None
        except OverCapacity as exc:
            raise ApiError(429, str(exc)) from None

    @route("POST", "/v1/create_model")
    async def create_model(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.CreateModelRequest)
        base = self.callers.base(body.base_model)
        lora = body.lora_config or types.LoraConfig(rank=min(32, self.limits.max_lora_rank))  # the SDK's default rank
        try:
            self.limits.lora_rank(lora.rank)
            self.limits.optimizer(body.optimizer_config)
        except Refused as exc:
            raise ApiError(400, str(exc)) from None
        model = self._reserve(body.session_id, tenant.run, body.model_seq_id, base, lora.rank)
        model.spec = AdapterSpec(lora.rank, lora.seed, lora.train_attn, lora.train_mlp)

        async def work() -> Result:
            try:
                await self.recovery.run_on(model.learner, lambda learner: learner.create(model.model_id, model.spec))
            except RequestFailed:
                self.sessions.forget_model(model.model_id)
                raise
            return Result(json=as_json(types.CreateModelResponse(model_id=model.model_id)))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    @route("POST", "/v1/get_info")
    async def get_info(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.GetInfoRequest)
        model = self.callers.model(body.model_id, tenant)
        tokenizer = self.settings.tokenizer_id or self.settings.model_path
        data = types.ModelData(arch="qwen2", model_name=model.base_model, tokenizer_id=tokenizer)
        info = types.GetInfoResponse(
            model_data=data, model_id=model.model_id, is_lora=True, lora_rank=model.rank, model_name=model.base_model
        )
        return as_json(info)

    @route("POST", "/v1/forward_backward")
    async def forward_backward(self, request: Request) -> dict:
        """The body is parsed and checked against the limits (`Limits.loss_call`) in a worker thread: its size and
        its tensors' shapes are the tenant's to choose, the event loop every tenant's."""
        tenant = await self.callers.tenant(request)
        body = await self.body(request)
        try:
            message = await offload(parse_forward_backward, body)
        except WireError as exc:
            raise ApiError(400, str(exc)) from None
        model = self.callers.model(message.model_id, tenant, message.seq_id, request)
        try:
            call = await offload(self.limits.loss_call, message)
        except (WireError, Refused) as exc:
            raise ApiError(400, str(exc)) from None

        async def work() -> Result:
            async with model.turn(message.seq_id):
                reply = await self.recovery.run(model, tenant, lambda learner: learner.forward_backward(call))
                if call.backward:
                    model.pending = model.trained = True
                    await self.recovery.after_training(model, tenant)  # a notice: the gradient must survive it
            return Result(proto=encode_forward_backward_output(reply.logprobs, reply.metrics))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    @route("POST", "/v1/optim_step")
    async def optim_step(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.OptimStepRequest)
        model = self.callers.model(body.model_id, tenant, body.seq_id, request)
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise ApiError(400, f"optim_params: only AdamParams (adamw) is supported, got {type(params).__name__}")
        step = AdamStep(
            model.model_id,
            params.learning_rate,
            params.beta1,
            params.beta2,
            params.eps,
            params.weight_decay,
            params.grad_clip_norm,
        )

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                reply = await self.recovery.run(model, tenant, lambda learner: learner.optim_step(step))
                model.trained, model.pending = True, False
                await self.recovery.after_training(model, tenant)  # a notice: this step must survive it
            return Result(json=as_json(types.OptimStepResponse(metrics=reply.metrics)))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    @route("POST", "/v1/save_weights_for_sampler")
    async def save_for_sampler(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.SaveWeightsForSamplerRequest)
        model = self.callers.model(body.model_id, tenant, body.seq_id, request)
        expires = expiry(body.ttl_seconds)
        path = None if body.path is None else checkpoint_path(model.model_id, "sampler", body.path)
        metadata = user_metadata(body.user_metadata)

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self.callers.lineage(tenant)
                published = await self.recovery.run(
                    model, tenant, lambda learner: learner.publish(model.model_id, lineage)
                )
                if path is not None:
                    await self.paths.remember(
                        model, lineage, path, "sampler", published.version, expires, user_metadata=metadata
                    )
            fleet_model = adapter_name(published.version, tenant.run)
            try:
                await self.fleet.load_adapter(tenant, fleet_model, published.key)
            except FleetRefused as refused:
                raise RequestFailed(f"the fleet did not load {fleet_model}: {refused.message}", "server") from None
            if path is None:  # save_weights_and_get_sampling_client: a sampler at once
                sampler = self.sessions.add_sampler(tenant.run, model.session_id, fleet_model, model.base_model, None)
                reply = types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler.sampler_id)
            else:
                reply = types.SaveWeightsForSamplerResponseInternal(path=path)
            return Result(json=as_json(reply))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    @route("POST", "/v1/save_weights")
    async def save_state(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.SaveWeightsRequest)
        model = self.callers.model(body.model_id, tenant, body.seq_id, request)
        expires = expiry(body.ttl_seconds)
        path = checkpoint_path(model.model_id, "training", body.path or "")
        metadata = user_metadata(body.user_metadata)
        if not body.overwrite and await self._exists(tenant, path):
            raise ApiError(400, f"{path}: a checkpoint of that name exists; save with overwrite=True to replace it")

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self.callers.lineage(tenant)
                if not body.overwrite and await asyncio.to_thread(own_record, lineage.bucket_url, path):
                    raise RequestFailed(f"{path} exists: save with overwrite=True to replace it", "user")
                number = await self.recovery.run(
                    model, tenant, lambda learner: learner.save_state(model.model_id, lineage, False)
                )
                await self.paths.remember(model, lineage, path, "training", number, expires, user_metadata=metadata)
                # A user's state holds no gradient: one accumulated and not yet applied is still unsaved. A restarted
                # learner restores the client from it (an expiry makes it no less the client's newest state).
                model.saved, model.saved_from, model.trained = number, None, model.pending
            return Result(json=as_json(types.SaveWeightsResponse(path=path)))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    async def _exists(self, tenant, path: str) -> bool:
        lineage = await self.callers.lineage_now(tenant)
        return await asyncio.to_thread(own_record, lineage.bucket_url, path) is not None

    @route("POST", "/v1/save_weights_external")
    async def save_external(self, request: Request) -> dict:
        """`save_weights_external(name)`: the adapter as a PEFT folder in the tenant's exports, to be downloaded through
        `get_external_weights_urls` (what `tinker checkpoint download` does)."""
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.SaveWeightsExternalRequest)
        model = self.callers.model(body.model_id, tenant, body.seq_id, request)
        expires = expiry(body.ttl_seconds)
        if body.age_encryption_recipients:
            raise ApiError(400, "age_encryption_recipients: this server does not encrypt exports")
        path = checkpoint_path(model.model_id, "external", body.path)

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self.callers.lineage(tenant)
                export = await self.recovery.run(model, tenant, lambda learner: learner.export(model.model_id, lineage))
                await self.paths.remember(
                    model, lineage, path, "external", export.number, expires, size_bytes=export.size_bytes
                )
            reply = types.SaveWeightsExternalResponseInternal(path=path, size_bytes=export.size_bytes)
            return Result(json=as_json(reply))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)

    @route("POST", "/v1/load_weights")
    async def load_state(self, request: Request) -> dict:
        """create_training_client_from_state (a new client, `session_id` + `model_seq_id`) or the deprecated
        load_state onto an existing one (`model_id` + `seq_id`)."""
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.LoadWeightsRequest)
        if body.session_id is None and body.model_id is not None:  # onto a client: its turn is claimed first
            self.callers.model(body.model_id, tenant, body.seq_id, request)
        found = await self.paths.recall(tenant, body.path, "training")
        if found is None:
            raise ApiError(404, f"path {body.path[:200]!r}: no saved state of this API key, nor a published one")
        number, source = found
        if body.session_id is not None:
            self.callers.base(body.base_model)
            model = self._reserve(body.session_id, tenant.run, body.model_seq_id or 0, self.settings.base_model, 0)
            turn = contextlib.nullcontext
        elif body.model_id is not None:
            model = self.callers.model(body.model_id, tenant)
            turn = lambda: model.turn(body.seq_id or 0)  # noqa: E731
        else:
            raise ApiError(400, "LoadWeightsRequest: set session_id and model_seq_id, or model_id and seq_id")

        async def work() -> Result:
            async with turn():
                lineage = await self.callers.lineage(tenant)
                spec = await self.recovery.run_on(
                    model.learner,
                    lambda learner: learner.load_state(model.model_id, lineage, number, body.optimizer, source),
                )
            model.rank, model.spec, model.saved, model.saved_from = spec.rank, spec, number, source
            model.trained = model.pending = False
            return Result(json=as_json(types.LoadWeightsResponse(path=body.path, model_id=model.model_id)))

        return accepted(self.futures.submit(tenant.run, work()), model.model_id)
