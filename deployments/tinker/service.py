"""The Tinker API's HTTP routes: what the unchanged `tinker` SDK calls under `/api/v1/`, answered with its own types.

Requests are parsed with the SDK's request models (`tinker.types.*Request`, strict: an unknown field is a 400) or
its protobuf (`deployments.tinker.wire`), and replies built with its response models. Long work (the learner's, the
fleet's) is accepted at once as a future (`deployments.tinker.futures`) and retrieved by id. Errors are JSON
`{"detail": ...}` with the status the SDK acts on: 400 malformed, 401 unknown key, 404 not this key's, 410 a
released session, 413 too large, 429 over capacity (the SDK backs off and retries), 503 the learner or the fleet
unreachable (retried too).

The app is independent of Ray: a learner is any object with `async call(method, *args)` (`RayLearner` in Serve, a
fake in the unit tests) and the fleet is reached over HTTP (`FleetCalls`). With several learners (`learners`) each
training client lives on one of them, the one holding fewest when it was created; calls that read or write the bucket
only go to the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from tinker import types
from tinker.types.checkpoint import ParsedCheckpointTinkerPath
from tinker.types.get_server_capabilities_response import SupportedModel
from tinker.types.try_again_response import TryAgainResponse  # the SDK's own poll answer, not exported by tinker.types

from contracts.adapters import adapter_name
from contracts.auth import Secret, token_matches
from contracts.tinker import AdamStep, AdapterSpec, LearnerLost
from core.bucket.tinker_paths import own_record
from deployments.api.callers import require_json
from deployments.api.intake import read_body
from deployments.control.errors import ApiError
from deployments.control.offload import offload
from deployments.tinker.exports import LINK_TTL_S, ExportLinks, Link, LinkGone, LinkRefused
from deployments.tinker.fleet_calls import FleetCalls, FleetRefused, Tenant
from deployments.tinker.futures import Futures, RequestFailed, Result
from deployments.tinker.limits import Limits, Refused
from deployments.tinker.paths import PathRefused, checkpoint_path, owner_key, require_kind, user_metadata
from deployments.tinker.sessions import Model, NotFound, OverCapacity, Sessions
from deployments.tinker.settings import TinkerSettings
from deployments.tinker.tenants import Tenants
from deployments.tinker.turns import TurnRefused
from deployments.tinker.wire import (
    PROTOBUF,
    Sequence,
    WireError,
    decompress,
    encode_forward_backward_output,
    encode_sample_response,
    parse_forward_backward,
)

log = logging.getLogger("ray.serve")

UPKEEP_PERIOD_S = 5.0
LEARNER_RETRY_S = 1.0  # how often a call waiting for a lost learner tries again
MAX_LISTED = 1000  # checkpoints one listing page may hold
TTL_RANGE_S = (3600, 10 * 365 * 86400)  # a checkpoint's ttl_seconds, as the SDK documents it: 1 hour to 10 years


class TtlRequest(pydantic.BaseModel):
    """The body `RestClient.set_checkpoint_ttl_from_tinker_path` puts (a plain dict in the SDK)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    ttl_seconds: int | None = pydantic.Field(description="Seconds from now until the checkpoint expires; None: never.")


class WeightsInfoRequest(pydantic.BaseModel):
    """The body `RestClient.get_weights_info_by_tinker_path` posts (the SDK sends a plain dict, it has no type)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    tinker_path: str = pydantic.Field(description="The saved path to describe.")


def _page(request: Request) -> tuple[int, int]:
    """A listing's `limit` and `offset` query parameters, checked."""
    try:
        limit = int(request.query_params.get("limit", 100))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise HttpError(400, "limit and offset must be integers") from None
    if not (1 <= limit <= MAX_LISTED and offset >= 0):
        raise HttpError(400, f"limit must be 1..{MAX_LISTED} and offset at least 0")
    return limit, offset


def _expiry(ttl_seconds: int | None) -> float | None:
    """When a checkpoint saved (or given a TTL) now with `ttl_seconds` expires, in epoch seconds; None: never."""
    if ttl_seconds is None:
        return None
    low, high = TTL_RANGE_S
    if not low <= ttl_seconds <= high:
        raise HttpError(400, f"ttl_seconds {ttl_seconds}: must be between {low} (1 hour) and {high} (10 years)")
    return time.time() + ttl_seconds


def _parsed_path(path: str) -> ParsedCheckpointTinkerPath:
    try:
        return ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as exc:
        raise HttpError(400, f"tinker path {path[:200]!r}: {exc}") from None


def _checkpoint_path(training_run_id: str, checkpoint_id: str) -> tuple[str, ParsedCheckpointTinkerPath]:
    """The tinker path a checkpoint route names (`/training_runs/{id}/checkpoints/{checkpoint_id}`), checked."""
    path = f"tinker://{training_run_id}/{checkpoint_id}"
    return path, _parsed_path(path)


class HttpError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def client_config() -> types.ClientConfigResponse:
    """The SDK's feature flags for this server: plain API keys, httpx, zstd forward_backward bodies, one
    retrieve_future per request, custom losses on the client."""
    return types.ClientConfigResponse(
        pjwt_auth_enabled=False,
        use_pyqwest_transport=False,
        proto_compress_fwdbwd=True,
        sample_use_retrieve_futures=False,
        custom_loss_server_side=False,
        sample_join_sampling_session=False,
    )


def _json(model: pydantic.BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


class TinkerApi:
    """The routes over the service's state; `make_app` mounts them."""

    def __init__(self, settings: TinkerSettings, learners: list, fleet: FleetCalls, admin_token: Secret | None):
        self.settings, self.learners, self.fleet = settings, learners, fleet
        self.admin_token = admin_token
        self.sessions = Sessions(
            settings.max_models,
            settings.max_models_per_tenant,
            settings.session_idle_s,
            len(learners),
            max_samplers_per_tenant=settings.max_samplers_per_tenant,
            turn_wait_s=settings.turn_wait_s,
            max_seq_ahead=settings.max_seq_ahead,
        )
        self.limits = Limits.of(settings)
        # Late-bound `self.fleet`: the key is checked with whatever fleet the service talks to (the tests' fake too).
        self.keys = Tenants(lambda api_key: self.fleet.tenant(api_key), self._revoked, settings.key_recheck_s)
        self.futures = Futures(settings.future_ttl_s)
        self.tenants: dict[str, Tenant] = {}  # the latest caller of each run: whom a spot notice's saves are for
        self.links = ExportLinks(admin_token, settings.cache_dir)
        self.adopted: dict[tuple[str, str, int], int] = {}  # (run, published path, its version) -> the run's copy

    # ---- reading a request ------------------------------------------------------------------------------

    async def body(self, request: Request) -> bytes:
        """The body, bounded as the fleet's are (`deployments.api.intake.read_body`: a 413 by its Content-Length
        before a byte is read, else while it streams in), inflated off the event loop when zstd."""
        limit = self.settings.max_body_bytes
        try:
            raw = await read_body(request, limit)
        except ApiError as refused:
            raise HttpError(refused.status, refused.message) from None
        encoding = request.headers.get("content-encoding")
        try:
            return await offload(decompress, raw, encoding, limit) if raw and encoding else raw
        except WireError as exc:
            raise HttpError(400, str(exc)) from None

    async def parse(self, request: Request, model: type[pydantic.BaseModel]):
        raw = await self.body(request)
        try:
            return await offload(model.model_validate_json, raw or b"{}")
        except pydantic.ValidationError as exc:
            reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:4])
            raise HttpError(400, f"{model.__name__}: {reasons}") from None

    async def tenant(self, request: Request) -> Tenant:
        try:
            tenant = await self.keys.resolve(request.headers.get("x-api-key"))
        except FleetRefused as refused:
            raise HttpError(503, f"the fleet could not check the API key: {refused.message}") from None
        if tenant is None:
            raise HttpError(401, "missing or unknown API key (X-API-Key: tml-<run token>; the admin creates keys)")
        self.tenants[tenant.run] = tenant
        return tenant

    # ---- service ----------------------------------------------------------------------------------------

    async def create_session(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        await self.parse(request, types.CreateSessionRequest)
        return _json(types.CreateSessionResponse(session_id=self.sessions.open(tenant.run)))

    async def heartbeat(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.SessionHeartbeatRequest)
        try:
            self.sessions.heartbeat(body.session_id, tenant.run)
        except NotFound as exc:
            raise HttpError(410, str(exc)) from None
        return _json(types.SessionHeartbeatResponse())

    async def finish_session(self, request: Request, session_id: str) -> dict:
        """The SDK's `close`. A session that is not open for the key (released after silence, or opened with a service
        that has since restarted) is finished already: the SDK's close succeeds, and nothing of anyone's is touched."""
        tenant = await self.tenant(request)
        await self.body(request)
        try:
            released = self.sessions.close(session_id, tenant.run)
        except NotFound:
            return {}
        for model_id in released:
            await self._drop(model_id)
        return {}

    async def capabilities(self, request: Request) -> dict:
        await self.tenant(request)
        model = SupportedModel(
            model_name=self.settings.base_model,
            max_context_length=self.settings.max_context,
            trainable=True,
            sampleable=True,
        )
        return _json(types.GetServerCapabilitiesResponse(supported_models=[model]))

    async def create_key(self, request: Request) -> dict:
        """`POST /api/v1/admin/keys {"name", "lora_rank"}`: the admin makes a tenant (a run of the fleet), its key."""
        header = request.headers.get("authorization") or f"Bearer {request.headers.get('x-api-key', '')}"
        if self.admin_token is None or not token_matches(header, self.admin_token.value):
            raise HttpError(401, "creating an API key needs the fleet's admin token")
        try:
            require_json(request)  # as the fleet's admin calls: a web page cannot send it to 127.0.0.1
        except ApiError as refused:
            raise HttpError(refused.status, refused.message) from None
        body = await self.body(request)
        try:
            spec = pydantic.TypeAdapter(dict[str, Any]).validate_json(body or b"{}")
            name, rank = str(spec["name"]), spec.get("lora_rank")
        except (pydantic.ValidationError, KeyError) as exc:
            raise HttpError(400, f"expected {{'name': ..., 'lora_rank': ...}}: {exc}") from None
        try:
            key = await self.fleet.register(self.admin_token.value, name, rank)
        except FleetRefused as refused:
            raise HttpError(refused.status, refused.message) from None
        return {"name": name, "api_key": key}

    # ---- training ---------------------------------------------------------------------------------------

    def _check_base(self, base_model: str | None) -> str:
        if base_model not in (self.settings.base_model, self.settings.model_path, None):  # its id, or its folder
            raise HttpError(400, f"base_model {base_model!r}: this server trains {self.settings.base_model!r} only")
        return self.settings.base_model

    def _accept(self, tenant: Tenant, work, model_id: str | None = None, **extra) -> dict:
        request_id = self.futures.submit(tenant.run, work)
        return _json(types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra))

    async def _learner(
        self, method: str, *args, model: Model | None = None, tenant: Tenant | None = None, on: int | None = None
    ):
        """A call of learner `on` (else `model`'s learner, else the first), riding out a lost learner: while it is gone
        (a preempted node; Ray starts it again) the call waits, so the client's future says `try_again`, up to
        `learner_wait_s`; a learner that came back without `model`'s adapter restores it from the client's last
        `save_state`, then the call runs."""
        learner = self.learners[on if on is not None else model.learner if model is not None else 0]
        deadline = asyncio.get_running_loop().time() + self.settings.learner_wait_s
        restored = False
        while True:
            try:
                return await learner.call(method, *args)
            except LearnerLost as lost:
                if asyncio.get_running_loop().time() > deadline:
                    raise RequestFailed(f"the learner is unavailable: {lost}", "server") from None
                await asyncio.sleep(LEARNER_RETRY_S)
            except KeyError as missing:
                if model is None or tenant is None or restored:
                    raise RequestFailed(str(missing), "user") from None
                if model.saved is None:
                    raise RequestFailed(
                        f"the learner restarted and model {model.model_id} had no saved state (save_state) to "
                        "resume from; create a training client again",
                        "server",
                    ) from None
                log.info("tinker: restoring %s from its state %d after a learner restart", model.model_id, model.saved)
                lineage = await self._lineage(tenant)
                await learner.call("load_state", model.model_id, lineage, model.saved, True, model.saved_from)
                model.restores += 1
                restored = True
            except ValueError as exc:
                raise RequestFailed(str(exc), "user") from None

    async def _notice(self, learner: int) -> str | None:
        """The spot notice learner `learner`'s node has, in words; None without one, or with no learner to ask."""
        try:
            return await self.learners[learner].call("notice")
        except Exception:  # noqa: BLE001 - a learner that is gone has no notice; its calls wait for the next one
            return None

    async def _keep(self, model: Model, tenant: Tenant) -> None:
        """Save `model`'s state (adapter, optimizer and a gradient not yet applied) as the one a restarted learner
        restores it from, unseen by the user's saved paths: after a spot notice, the learner Ray starts again elsewhere
        loses no step and no `forward_backward`."""
        lineage = await self._lineage(tenant)
        model.saved = await self._learner("save_state", model.model_id, lineage, None, True, model=model, tenant=tenant)
        model.saved_from = None
        model.trained = False

    async def keep_everyone(self, notice: str, learner: int = 0) -> None:
        """A spot notice for learner `learner`'s node: save each of its clients that trained since its last saved
        state."""
        for model in [m for m in self.sessions.models.values() if m.trained and m.learner == learner]:
            tenant = self.tenants.get(model.tenant)
            if tenant is None:
                continue
            try:
                await self._keep(model, tenant)
                log.warning("tinker: %s; %s saved, to be restored where it stopped", notice, model.model_id)
            except Exception as exc:  # noqa: BLE001 - the next optimizer step saves it again, while the notice lasts
                log.warning("tinker: %s; %s could not be saved: %s", notice, model.model_id, exc)

    async def _drop(self, model_id: str) -> None:
        """Release `model_id`'s adapter wherever it is (a no-op on the learners that do not hold it)."""
        for learner in self.learners:
            with contextlib.suppress(Exception):  # a learner that is gone holds nothing to drop
                await learner.call("drop", model_id)

    async def _revoked(self, run: str) -> None:
        """The fleet no longer knows run `run` (the admin removed it, or it went idle): its futures are cancelled, its
        sessions, samplers and training clients released, and what is cached of it forgotten."""
        self.futures.cancel_tenant(run)
        for model_id in self.sessions.close_tenant(run):
            await self._drop(model_id)
        self.tenants.pop(run, None)
        self.fleet.forget(run)
        self.adopted = {key: copy for key, copy in self.adopted.items() if key[0] != run}

    async def drop_orphans(self) -> None:
        """Drop the learners' adapters that no session of this service holds: a service started again (its node
        lost) knows none of the sessions before it, whose adapters would otherwise hold the learners' capacity."""
        for index, learner in enumerate(self.learners):
            try:
                held = await learner.call("models") or []
            except Exception:  # noqa: BLE001 - a learner that is gone holds nothing; the next round asks again
                continue
            mine = {m.model_id for m in self.sessions.models.values() if m.learner == index}
            for model_id in set(held) - mine:
                log.info("tinker: releasing %s (no session of this service holds it there)", model_id)
                with contextlib.suppress(Exception):
                    await learner.call("drop", model_id)

    async def create_model(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.CreateModelRequest)
        base = self._check_base(body.base_model)
        lora = body.lora_config or types.LoraConfig(rank=min(32, self.limits.max_lora_rank))  # the SDK's default rank
        try:
            self.limits.lora_rank(lora.rank)
            self.limits.optimizer(body.optimizer_config)
        except Refused as exc:
            raise HttpError(400, str(exc)) from None
        try:
            model = self.sessions.reserve_model(body.session_id, tenant.run, body.model_seq_id, base, lora.rank)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None
        except OverCapacity as exc:
            raise HttpError(429, str(exc)) from None
        spec = AdapterSpec(lora.rank, lora.seed, lora.train_attn, lora.train_mlp)

        async def work() -> Result:
            try:
                await self._learner("create", model.model_id, spec, on=model.learner)
            except RequestFailed:
                self.sessions.forget_model(model.model_id)
                raise
            return Result(json=_json(types.CreateModelResponse(model_id=model.model_id)))

        return self._accept(tenant, work(), model.model_id)

    async def get_info(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.GetInfoRequest)
        model = self._model(body.model_id, tenant)
        tokenizer = self.settings.tokenizer_id or self.settings.model_path
        data = types.ModelData(arch="qwen2", model_name=model.base_model, tokenizer_id=tokenizer)
        info = types.GetInfoResponse(
            model_data=data, model_id=model.model_id, is_lora=True, lora_rank=model.rank, model_name=model.base_model
        )
        return _json(info)

    def _model(self, model_id: str, tenant: Tenant, seq_id: int | None = None, request: Request | None = None):
        """The tenant's training client `model_id` (404 else); with `seq_id`, that number is claimed for `request`
        (`Turns.claim`): should the route then refuse it, its turn is given up (`give_up_turn`), since the SDK has
        used the number and a hole would hold every later request of the client."""
        try:
            model = self.sessions.model(model_id, tenant.run)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None
        if seq_id is not None:
            try:
                model.turns.claim(seq_id)
            except TurnRefused as refused:
                raise HttpError(refused.status, refused.message) from None
            if request is not None:
                request.state.turn = (model, seq_id)
        return model

    async def forward_backward(self, request: Request) -> dict:
        """The body is parsed and checked against the limits (`Limits.loss_call`) in a worker thread: its size and
        its tensors' shapes are the tenant's to choose, the event loop every tenant's."""
        tenant = await self.tenant(request)
        body = await self.body(request)
        try:
            message = await offload(parse_forward_backward, body)
        except WireError as exc:
            raise HttpError(400, str(exc)) from None
        model = self._model(message.model_id, tenant, message.seq_id, request)
        try:
            call = await offload(self.limits.loss_call, message)
        except (WireError, Refused) as exc:
            raise HttpError(400, str(exc)) from None
        seq_id = message.seq_id

        async def work() -> Result:
            async with model.turn(seq_id):
                reply = await self._learner("forward_backward", call, model=model, tenant=tenant)
                if call.backward:
                    model.pending = model.trained = True
                    if await self._notice(model.learner) is not None:  # the node is going: the gradient must survive it
                        await self._keep(model, tenant)
            return Result(proto=encode_forward_backward_output(reply.logprobs, reply.metrics))

        return self._accept(tenant, work(), model.model_id)

    async def optim_step(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.OptimStepRequest)
        model = self._model(body.model_id, tenant, body.seq_id, request)
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise HttpError(400, f"optim_params: only AdamParams (adamw) is supported, got {type(params).__name__}")
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
                metrics = await self._learner("optim_step", step, model=model, tenant=tenant)
                model.trained, model.pending = True, False
                if await self._notice(model.learner) is not None:  # the node is going: this step must survive it
                    await self._keep(model, tenant)
            return Result(json=_json(types.OptimStepResponse(metrics=metrics)))

        return self._accept(tenant, work(), model.model_id)

    async def save_for_sampler(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.SaveWeightsForSamplerRequest)
        model = self._model(body.model_id, tenant, body.seq_id, request)
        expires = _expiry(body.ttl_seconds)
        path = None if body.path is None else checkpoint_path(model.model_id, "sampler", body.path)
        metadata = user_metadata(body.user_metadata)

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self._lineage(tenant)
                published = await self._learner(
                    "publish", model.model_id, lineage, path, expires, metadata, model=model, tenant=tenant
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
                if expires is None:  # a path that expires is always looked up in the bucket, where its expiry is
                    self.sessions.sampler_paths[path] = (tenant.run, published.version)
                reply = types.SaveWeightsForSamplerResponseInternal(path=path)
            return Result(json=_json(reply))

        return self._accept(tenant, work(), model.model_id)

    async def _recall(
        self, tenant: Tenant, path: str, paths: dict[str, tuple[str, int]], kind: str
    ) -> tuple[int, str | None] | None:
        """The state number or sampler version that the tinker `path` names for this tenant, and where: None for its
        own prefix, else the prefix of the tenant that published it. Its own paths are remembered here, else read
        back from the bucket, where the learner recorded them (so a service that restarted knows the paths it handed
        out before); another tenant's published path is looked up every time (its owner may take it back). None for a
        path the tenant cannot reach; a 400 for one whose record is of another `kind` (each kind numbers from 1 in a
        store of its own: its number would name another checkpoint)."""
        saved = paths.get(path)
        if saved is not None and saved[0] == tenant.run:
            return saved[1], None
        record = await self._from_bucket(tenant, f"path {path[:200]!r}", "record", path)
        if record is None:
            return None
        require_kind(record, kind, path)
        if record.get("prefix") is None and record.get("expires") is None:
            paths[path] = (tenant.run, int(record["number"]))
        return int(record["number"]), record.get("prefix")

    async def _from_bucket(self, tenant: Tenant, what: str, method: str, *args):
        """A learner call that reads the tenant's prefix of the bucket, from a route that answers at once (no future):
        a learner or fleet that cannot answer is a 503 naming `what`."""
        try:
            return await self._learner(method, await self._lineage(tenant), *args)
        except RequestFailed as failed:
            raise HttpError(503, f"{what}: {failed.message}") from None

    async def _bucket_lineage(self, tenant: Tenant):
        """`_lineage`, from a route that answers at once: a fleet that cannot say is a 503."""
        try:
            return await self._lineage(tenant)
        except RequestFailed as failed:
            raise HttpError(503, failed.message) from None

    async def _lineage(self, tenant: Tenant):
        try:
            return await self.fleet.lineage(tenant)
        except FleetRefused as refused:
            raise RequestFailed(f"the fleet has no lineage for run {tenant.run}: {refused.message}", "server") from None

    async def save_state(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.SaveWeightsRequest)
        model = self._model(body.model_id, tenant, body.seq_id, request)
        expires = _expiry(body.ttl_seconds)
        path = checkpoint_path(model.model_id, "training", body.path or "")
        metadata = user_metadata(body.user_metadata)
        if not body.overwrite and await asyncio.to_thread(
            own_record, (await self._bucket_lineage(tenant)).bucket_url, path
        ):
            raise HttpError(400, f"{path}: a checkpoint of that name exists; save with overwrite=True to replace it")

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self._lineage(tenant)
                args = (path, False, expires, body.overwrite, metadata)
                number = await self._learner("save_state", model.model_id, lineage, *args, model=model, tenant=tenant)
                # A user's state holds no gradient: one accumulated and not yet applied is still unsaved. A restarted
                # learner restores the client from it (an expiry makes it no less the client's newest state).
                model.saved, model.saved_from, model.trained = number, None, model.pending
            if expires is None:
                self.sessions.state_paths[path] = (tenant.run, number)
            return Result(json=_json(types.SaveWeightsResponse(path=path)))

        return self._accept(tenant, work(), model.model_id)

    async def save_external(self, request: Request) -> dict:
        """`save_weights_external(name)`: the adapter as a PEFT folder in the tenant's exports, to be downloaded through
        `get_external_weights_urls` (what `tinker checkpoint download` does)."""
        tenant = await self.tenant(request)
        body = await self.parse(request, types.SaveWeightsExternalRequest)
        model = self._model(body.model_id, tenant, body.seq_id, request)
        expires = _expiry(body.ttl_seconds)
        if body.age_encryption_recipients:
            raise HttpError(400, "age_encryption_recipients: this server does not encrypt exports")
        path = checkpoint_path(model.model_id, "external", body.path)

        async def work() -> Result:
            async with model.turn(body.seq_id or 0):
                lineage = await self._lineage(tenant)
                export = await self._learner(
                    "export", model.model_id, lineage, path, expires, model=model, tenant=tenant
                )
            reply = types.SaveWeightsExternalResponseInternal(path=path, size_bytes=export.size_bytes)
            return Result(json=_json(reply))

        return self._accept(tenant, work(), model.model_id)

    async def external_weights_urls(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.get_external_weights_urls(path)`: a download link per file of one of the key's exports, each
        working without the key for `LINK_TTL_S` (`deployments.tinker.exports`)."""
        tenant = await self.tenant(request)
        path, parsed = _checkpoint_path(training_run_id, checkpoint_id)
        if parsed.checkpoint_type != "external":
            raise HttpError(400, f"{path}: only exported weights (external_weights) have download links")
        record = await self._from_bucket(tenant, f"path {path[:200]!r}", "record", path)
        if record is None:
            raise HttpError(404, f"{path}: no such checkpoint for this API key")
        require_kind(record, "external", path)
        prefix = record.get("prefix") or (await self._bucket_lineage(tenant)).bucket_url  # a published export's owner's
        link = Link(prefix, path, int(record["number"]), owner=record.get("prefix") is None)
        try:
            files = await asyncio.to_thread(self.links.files, link.store_url, link.number)
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile, or the bucket unreachable
            raise HttpError(503, f"{path}: the export's files could not be listed: {exc}") from None
        expires = time.time() + LINK_TTL_S
        token = self.links.sign(link, expires)
        # Back to this service, at the address the caller used (the Serve route prefix included).
        base = str(request.url).split("/v1/training_runs/", 1)[0]
        urls = {rel: f"{base}/v1/exported/{token}/{rel}" for rel in sorted(files)}
        return _json(types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC)))

    async def exported_file(self, token: str, name: str) -> Response:
        """A file of an export, for a signed link (no API key: the SDK downloads with a plain GET)."""
        try:
            link = self.links.check(token)
        except LinkRefused as refused:
            raise HttpError(403, str(refused)) from None
        try:
            await asyncio.to_thread(self.links.still_there, link)  # the owner's record now, not the signature, decides
        except LinkGone as gone:
            raise HttpError(404, str(gone)) from None
        except Exception as exc:  # noqa: BLE001 - the bucket unreachable
            raise HttpError(503, f"the export's record could not be read: {exc}") from None
        store_url, number = link.store_url, link.number
        try:
            local = await self.links.local_file(store_url, number, name)
        except Exception as exc:  # noqa: BLE001 - the export was deleted, or the bucket is unreachable
            raise HttpError(404, f"export {number}: its files could not be read: {exc}") from None
        if local is None:
            raise HttpError(404, f"export {number} has no file {name[:200]!r}")
        return FileResponse(local, media_type="application/octet-stream")

    async def set_ttl(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.set_checkpoint_ttl_from_tinker_path(path, ttl_seconds)`: the path expires that long from now
        (None: never); an expired path is gone from listings and lookups, and its files from the bucket."""
        tenant = await self.tenant(request)
        path, _ = _checkpoint_path(training_run_id, checkpoint_id)
        expires = _expiry((await self.parse(request, TtlRequest)).ttl_seconds)
        if not await self._from_bucket(tenant, f"path {path[:200]!r}", "expire", path, expires):
            raise HttpError(404, f"{path}: no such checkpoint for this API key")
        self._forget_path(path)  # looked up in the bucket from now on, where its expiry is
        return {}

    async def publish(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.publish_checkpoint_from_tinker_path(path)`: every key of the fleet may now start a training client
        from it, sample it (a copy under its own lineage) or download it; only this key deletes or unpublishes it."""
        return await self._share(request, training_run_id, checkpoint_id, True)

    async def unpublish(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.unpublish_checkpoint_from_tinker_path(path)`: other keys can no longer reach it (copies of sampler
        weights they already sample stay theirs)."""
        return await self._share(request, training_run_id, checkpoint_id, False)

    async def _share(self, request: Request, training_run_id: str, checkpoint_id: str, public: bool) -> dict:
        tenant = await self.tenant(request)
        path, _ = _checkpoint_path(training_run_id, checkpoint_id)
        await self.body(request)
        if not await self._from_bucket(tenant, f"path {path[:200]!r}", "share", path, public):
            raise HttpError(404, f"{path}: no such checkpoint of this API key (only its owner publishes it)")
        return {}

    def _forget_path(self, path: str) -> None:
        self.sessions.sampler_paths.pop(path, None)
        self.sessions.state_paths.pop(path, None)

    async def load_state(self, request: Request) -> dict:
        """create_training_client_from_state (a new client, `session_id` + `model_seq_id`) or the deprecated
        load_state onto an existing one (`model_id` + `seq_id`)."""
        tenant = await self.tenant(request)
        body = await self.parse(request, types.LoadWeightsRequest)
        if body.session_id is None and body.model_id is not None:  # onto a client: its turn is claimed first
            self._model(body.model_id, tenant, body.seq_id, request)
        found = await self._recall(tenant, body.path, self.sessions.state_paths, "training")
        if found is None:
            raise HttpError(404, f"path {body.path[:200]!r}: no saved state of this API key, nor a published one")
        number, source = found
        if body.session_id is not None:
            self._check_base(body.base_model)
            try:
                model = self.sessions.reserve_model(
                    body.session_id, tenant.run, body.model_seq_id or 0, self.settings.base_model, 0
                )
            except NotFound as exc:
                raise HttpError(404, str(exc)) from None
            except OverCapacity as exc:
                raise HttpError(429, str(exc)) from None
            turn = contextlib.nullcontext
        elif body.model_id is not None:
            model = self._model(body.model_id, tenant)
            turn = lambda: model.turn(body.seq_id or 0)  # noqa: E731
        else:
            raise HttpError(400, "LoadWeightsRequest: set session_id and model_seq_id, or model_id and seq_id")

        async def work() -> Result:
            async with turn():
                lineage = await self._lineage(tenant)
                spec = await self._learner(
                    "load_state", model.model_id, lineage, number, body.optimizer, source, on=model.learner
                )
            model.rank, model.saved, model.saved_from = spec.rank, number, source
            model.trained = model.pending = False
            return Result(json=_json(types.LoadWeightsResponse(path=body.path, model_id=model.model_id)))

        return self._accept(tenant, work(), model.model_id)

    # ---- sampling ---------------------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.CreateSamplingSessionRequest)
        self._session(body.session_id, tenant)
        if body.model_path:
            try:
                ParsedCheckpointTinkerPath.from_tinker_path(body.model_path)
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
            found = await self._recall(tenant, body.model_path, self.sessions.sampler_paths, "sampler")
            if found is None:
                raise HttpError(
                    404, f"model_path {body.model_path[:200]!r}: no sampler weights of this API key, nor published ones"
                )
            version = found[0] if found[1] is None else await self._adopted(tenant, body.model_path, *found)
            fleet_model = adapter_name(version, tenant.run)
            sampler = self.sessions.add_sampler(
                tenant.run, body.session_id, fleet_model, self.settings.base_model, body.model_path
            )
        else:
            base = self._check_base(body.base_model)
            sampler = self.sessions.add_sampler(tenant.run, body.session_id, base, base, None)
        return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampler.sampler_id))

    async def _adopted(self, tenant: Tenant, path: str, version: int, source: str) -> int:
        """This tenant's copy of another tenant's published sampler weights (`TinkerLearner.adopt`), loaded on the
        fleet: the fleet serves a tenant its own lineage only. One copy per published version and tenant."""
        key = (tenant.run, path, version)
        if key not in self.adopted:
            try:
                lineage = await self._lineage(tenant)
                # The original must verify under its owner's key: the copy is signed anew, with this tenant's.
                copy = await self._learner("adopt", lineage, source, version, owner_key(self.admin_token, source))
                await self.fleet.load_adapter(tenant, adapter_name(copy.version, tenant.run), copy.key)
            except (RequestFailed, FleetRefused) as failed:
                raise HttpError(503, f"{path[:200]}: the published weights could not be copied: {failed}") from None
            self.adopted[key] = copy.version
        return self.adopted[key]

    def _session(self, session_id: str, tenant: Tenant) -> None:
        try:
            self.sessions.session(session_id, tenant.run)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None

    # ---- checkpoints and training runs -------------------------------------------------------------

    async def list_user_checkpoints(self, request: Request) -> dict:
        """`RestClient.list_user_checkpoints(limit, offset)`: the key's saved states and sampler weights, newest first."""
        tenant = await self.tenant(request)
        limit, offset = _page(request)
        checkpoints = [checkpoint for _, checkpoint in await self._checkpoints(tenant)]
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(checkpoints))
        return _json(types.CheckpointsListResponse(checkpoints=checkpoints[offset : offset + limit], cursor=cursor))

    async def list_checkpoints(self, request: Request, training_run_id: str) -> dict:
        """`RestClient.list_checkpoints(training_run_id)`: those of one training client (a model id); another key's
        lists nothing, since a key's records lie in its own prefix."""
        tenant = await self.tenant(request)
        checkpoints = [
            c for _, c in await self._checkpoints(tenant) if c.tinker_path.startswith(f"tinker://{training_run_id}/")
        ]
        return _json(types.CheckpointsListResponse(checkpoints=checkpoints))

    async def delete_checkpoint(self, request: Request, training_run_id: str, checkpoint_id: str) -> dict:
        """`RestClient.delete_checkpoint(training_run_id, checkpoint_id)`: the saved state or sampler weights leave the
        bucket, and the path can no longer be loaded or sampled. 404 for a path this key was never given; 400 for the
        key's newest sampler weights (`TinkerLearner.forget` says why; the SDK retries a 409)."""
        tenant = await self.tenant(request)
        path, _ = _checkpoint_path(training_run_id, checkpoint_id)
        try:
            deleted = await self._learner("forget", await self._lineage(tenant), path)
        except RequestFailed as failed:
            raise HttpError(400 if failed.category == "user" else 503, f"{path}: {failed.message}") from None
        if not deleted:
            raise HttpError(404, f"{path}: no such checkpoint for this API key")
        self._forget_path(path)
        return {}

    async def weights_info(self, request: Request) -> dict:
        """`RestClient.get_weights_info_by_tinker_path(path)`: the base model and adapter a saved path holds."""
        tenant = await self.tenant(request)
        body = await self.parse(request, WeightsInfoRequest)
        _parsed_path(body.tinker_path)
        record = await self._from_bucket(tenant, f"path {body.tinker_path[:200]!r}", "record", body.tinker_path)
        if record is None:
            raise HttpError(404, f"{body.tinker_path}: no such checkpoint for this API key")
        info = types.WeightsInfoResponse(
            base_model=self.settings.base_model,
            is_lora=True,
            lora_rank=record.get("rank"),
            train_attn=record.get("train_attn"),
            train_mlp=record.get("train_mlp"),
            train_unembed=False,
        )
        return _json(info)

    async def list_training_runs(self, request: Request) -> dict:
        """`RestClient.list_training_runs(limit, offset)`: the key's training clients, those of its open sessions and
        those its saved paths name (gone ones too), the most recently used first."""
        tenant = await self.tenant(request)
        limit, offset = _page(request)
        runs = await self._training_runs(tenant)
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
        return _json(types.TrainingRunsResponse(training_runs=runs[offset : offset + limit], cursor=cursor))

    async def get_training_run(self, request: Request, training_run_id: str) -> dict:
        """`RestClient.get_training_run(id)`: one of them; another key's is not there (404)."""
        tenant = await self.tenant(request)
        run = next((r for r in await self._training_runs(tenant) if r.training_run_id == training_run_id), None)
        if run is None:
            raise HttpError(404, f"training run {training_run_id[:120]!r} does not exist for this API key")
        return _json(run)

    async def _training_runs(self, tenant: Tenant) -> list[types.TrainingRun]:
        runs: dict[str, dict[str, Any]] = {
            m.model_id: {"rank": m.rank, "time": m.touched}
            for m in self.sessions.models.values()
            if m.tenant == tenant.run
        }
        for record, checkpoint in reversed(await self._checkpoints(tenant)):  # oldest first: the newest wins
            run = runs.setdefault(_parsed_path(checkpoint.tinker_path).training_run_id, {"time": 0.0})
            run.setdefault("rank", record.get("rank"))
            run["time"] = max(run["time"], record["time"])
            run["sampler" if checkpoint.checkpoint_type == "sampler" else "state"] = checkpoint
        listed = [
            types.TrainingRun(
                training_run_id=run_id,
                base_model=self.settings.base_model,
                model_owner=tenant.run,
                is_lora=True,
                corrupted=False,
                lora_rank=run.get("rank"),
                last_request_time=datetime.fromtimestamp(run["time"], UTC),
                last_checkpoint=run.get("state"),
                last_sampler_checkpoint=run.get("sampler"),
            )
            for run_id, run in runs.items()
        ]
        return sorted(listed, key=lambda r: r.last_request_time, reverse=True)

    async def _checkpoints(self, tenant: Tenant) -> list[tuple[dict, types.Checkpoint]]:
        """The key's saved paths, newest first: each as the learner recorded it and as the SDK lists it."""
        records = await self._from_bucket(tenant, "checkpoints", "checkpoints")
        listed = []
        for record in records:
            parsed = ParsedCheckpointTinkerPath.from_tinker_path(record["path"])
            expires = record.get("expires")
            checkpoint = types.Checkpoint(
                checkpoint_id=parsed.checkpoint_id,
                checkpoint_type=parsed.checkpoint_type,
                time=datetime.fromtimestamp(record["time"], UTC),
                tinker_path=record["path"],
                size_bytes=record.get("size_bytes"),
                public=bool(record.get("public")),
                user_metadata=record.get("user_metadata"),
                expires_at=None if expires is None else datetime.fromtimestamp(expires, UTC),
            )
            listed.append((record, checkpoint))
        return listed

    async def get_sampler(self, request: Request, sampler_id: str) -> dict:
        tenant = await self.tenant(request)
        try:
            sampler = self.sessions.sampler(sampler_id, tenant.run)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None
        reply = types.GetSamplerResponse(
            sampler_id=sampler.sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
        )
        return _json(reply)

    async def asample(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise HttpError(400, "SampleRequest: sampling_session_id is required here")
        try:
            sampler = self.sessions.sampler(body.sampling_session_id, tenant.run)
        except NotFound as exc:
            raise HttpError(404, str(exc)) from None
        try:
            prompt = body.prompt.to_ints()
        except Exception as exc:  # noqa: BLE001 - an image chunk, say
            raise HttpError(400, f"prompt: only token chunks are supported ({exc})") from None
        try:
            self.limits.sample(body, prompt)
        except Refused as exc:
            raise HttpError(400, str(exc)) from None
        params = body.sampling_params
        stop = [params.stop] if isinstance(params.stop, str) else params.stop
        strings = bool(stop) and isinstance(next(iter(stop)), str)
        fleet_body: dict[str, Any] = {
            "model": sampler.fleet_model,
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

        async def work() -> Result:
            try:
                answer = await self.fleet.completions(tenant, fleet_body)
            except FleetRefused as refused:
                category = "user" if 400 <= refused.status < 500 and refused.status != 429 else "server"
                raise RequestFailed(f"the fleet refused the sample: {refused.message}", category) from None
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
            return Result(proto=encode_sample_response(sequences, prompt_logprobs))

        sequence_ids = [f"{uuid.uuid4().hex}" for _ in range(body.num_samples)]
        return self._accept(tenant, work(), sample_sequence_ids=sequence_ids)

    # ---- futures ----------------------------------------------------------------------------------------

    async def retrieve(self, request: Request) -> Response:
        tenant = await self.tenant(request)
        body = await self.parse(request, types.FutureRetrieveRequest)
        if not self.futures.owned(body.request_id, tenant.run):
            raise HttpError(404, f"future {body.request_id[:80]!r} does not exist for this API key")
        outcome = await self.futures.wait(body.request_id, self.settings.poll_wait_s)
        if outcome is None:
            pending = TryAgainResponse(request_id=body.request_id, queue_state="active")
            return JSONResponse(_json(pending))
        if isinstance(outcome, RequestFailed):
            category = types.RequestErrorCategory(outcome.category)
            return JSONResponse(_json(types.RequestFailedResponse(error=outcome.message, category=category)))
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTOBUF)
        return JSONResponse(outcome.json)

    async def cancel(self, request: Request) -> dict:
        tenant = await self.tenant(request)
        body = await self.body(request)
        request_id = pydantic.TypeAdapter(dict[str, str]).validate_json(body or b"{}").get("request_id", "")
        if self.futures.owned(request_id, tenant.run):
            self.futures.cancel(request_id)
        return {}

    # ---- upkeep -----------------------------------------------------------------------------------------

    async def upkeep(self) -> None:
        """`upkeep_round` every `UPKEEP_PERIOD_S`; a round that fails is logged and the next one runs all the same (one
        error must not end the releases, heartbeats and notice saves of every tenant for good)."""
        while True:
            await asyncio.sleep(UPKEEP_PERIOD_S)
            try:
                await self.upkeep_round()
            except Exception:  # noqa: BLE001 - whatever it was, the next round may pass
                log.exception("tinker: an upkeep round failed; the next one runs in %.0f s", UPKEEP_PERIOD_S)

    async def upkeep_round(self) -> None:
        """Release the sessions that went silent, and their adapters on the learner; on a spot notice for the
        learner's node, save the clients that trained since their last state (those stepping save after each step).
        Adapters on the learner that no session holds (a service's before this one) are released too. Every run that
        holds a session is kept alive on the fleet (`Tenants.keep_alive`), even one that only trains: first, so that
        no slow learner delays it."""
        in_session = {v.tenant for v in self.sessions.sessions.values()}
        await self.keys.keep_alive(in_session, self.fleet.heartbeat)
        self.keys.forget_idle(in_session, self.settings.session_idle_s)
        for model_id in self.sessions.take_idle():
            log.info("tinker: releasing %s (its session went silent)", model_id)
            await self._drop(model_id)
        await self.drop_orphans()
        holding = {m.tenant for m in self.sessions.models.values()}
        self.tenants = {run: t for run, t in self.tenants.items() if run in holding}
        for learner in range(len(self.learners)):
            notice = await self._notice(learner)
            if notice is not None:
                await self.keep_everyone(notice, learner)
        await asyncio.to_thread(self.links.prune)


def give_up_turn(request: Request) -> None:
    """A request refused after its training client's `seq_id` was claimed (`TinkerApi._model`) still takes its turn,
    without running: the SDK numbered the client's later requests after it."""
    claimed = getattr(request.state, "turn", None)
    if claimed is not None:
        model, seq_id = claimed
        model.turns.give_up(seq_id)


def make_app(settings: TinkerSettings, learners: list, admin_token: Secret | None = None) -> FastAPI:
    """The FastAPI app of the Tinker API; its paths are `/v1/...` under Serve's route prefix `/api`
    (`contracts.tinker.TINKER_ROUTE_PREFIX`), which Serve takes off before the app sees a path."""
    fleet = FleetCalls(settings.fleet_url, settings.cache_dir, lane=settings.sample_lane)
    api = TinkerApi(settings, learners, fleet, admin_token)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(api.upkeep())
        try:
            yield
        finally:
            task.cancel()
            await fleet.close()

    # No /docs, /redoc or /openapi.json: they would be served without a key (the fleet's app has none either).
    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

    @app.exception_handler(HttpError)
    async def _http_error(request, exc: HttpError):
        give_up_turn(request)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(PathRefused)
    async def _path_refused(request, exc: PathRefused):
        give_up_turn(request)
        return JSONResponse({"detail": exc.detail}, status_code=400)

    def post(path: str, handler):
        app.add_api_route(f"/v1/{path}", handler, methods=["POST"])

    async def config(_request: Request) -> dict:
        return _json(client_config())

    async def dynamic_config(_request: Request) -> dict:
        return _json(types.ClientDynamicConfigResponse())

    async def healthz() -> dict:
        return {"status": "ok"}

    async def telemetry(request: Request) -> dict:
        await api.body(request)  # bounded, then dropped: the SDK's telemetry stays on this machine, unread
        return _json(types.TelemetryResponse(status="accepted"))

    post("client/config", config)
    post("client/dynamic_config", dynamic_config)
    post("telemetry", telemetry)
    app.add_api_route("/v1/healthz", healthz, methods=["GET"])
    app.add_api_route("/v1/get_server_capabilities", api.capabilities, methods=["GET"])
    post("create_session", api.create_session)
    post("session_heartbeat", api.heartbeat)
    post("sessions/{session_id}/finish", api.finish_session)
    post("admin/keys", api.create_key)
    post("create_model", api.create_model)
    post("get_info", api.get_info)
    post("forward_backward", api.forward_backward)
    post("optim_step", api.optim_step)
    post("save_weights_for_sampler", api.save_for_sampler)
    post("save_weights", api.save_state)
    post("load_weights", api.load_state)
    post("create_sampling_session", api.create_sampling_session)
    app.add_api_route("/v1/samplers/{sampler_id}", api.get_sampler, methods=["GET"])
    app.add_api_route("/v1/checkpoints", api.list_user_checkpoints, methods=["GET"])
    app.add_api_route("/v1/training_runs/{training_run_id}/checkpoints", api.list_checkpoints, methods=["GET"])
    checkpoint = "/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}"
    app.add_api_route(f"{checkpoint}/external_weights_urls", api.external_weights_urls, methods=["GET"])
    app.add_api_route(f"{checkpoint}/ttl", api.set_ttl, methods=["PUT"])
    app.add_api_route(f"{checkpoint}/publish", api.publish, methods=["POST"])
    app.add_api_route(f"{checkpoint}/publish", api.unpublish, methods=["DELETE"])
    app.add_api_route(checkpoint, api.delete_checkpoint, methods=["DELETE"])
    app.add_api_route("/v1/training_runs", api.list_training_runs, methods=["GET"])
    app.add_api_route("/v1/training_runs/{training_run_id}", api.get_training_run, methods=["GET"])
    app.add_api_route("/v1/exported/{token}/{name:path}", api.exported_file, methods=["GET"])
    post("save_weights_external", api.save_external)
    post("weights_info", api.weights_info)
    post("asample", api.asample)
    post("retrieve_future", api.retrieve)
    post("cancel_future", api.cancel)
    return app
