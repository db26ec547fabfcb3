"""The `ServiceClient`'s routes: the client's config, sessions and their heartbeats, the server's capabilities, the
admin's API keys, and the futures every accepted request is retrieved (or cancelled) by."""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from tinker import types
from tinker.types.get_server_capabilities_response import SupportedModel
from tinker.types.try_again_response import TryAgainResponse  # the SDK's own poll answer, not exported by tinker.types

from contracts.auth import token_matches
from deployments.api.callers import require_json
from deployments.api.routing import route
from deployments.control.errors import ApiError
from deployments.tinker.fleet_calls import FleetRefused
from deployments.tinker.futures import RequestFailed
from deployments.tinker.http import as_json
from deployments.tinker.routes import TinkerRoutes
from deployments.tinker.sessions import NotFound
from deployments.tinker.wire import PROTOBUF


def client_config() -> types.ClientConfigResponse:
    """The SDK's feature flags for this server: plain API keys, the SDK's own default transport (pyqwest, as against
    Thinking Machines' service), zstd forward_backward bodies, one retrieve_future per request, custom losses on the
    client."""
    return types.ClientConfigResponse(
        pjwt_auth_enabled=False,
        use_pyqwest_transport=True,
        proto_compress_fwdbwd=True,
        sample_use_retrieve_futures=False,
        custom_loss_server_side=False,
        sample_join_sampling_session=False,
    )


class SessionRoutes(TinkerRoutes):
    @route("POST", "/v1/client/config")
    async def config(self, _request: Request) -> dict:
        return as_json(client_config())

    @route("POST", "/v1/client/dynamic_config")
    async def dynamic_config(self, _request: Request) -> dict:
        return as_json(types.ClientDynamicConfigResponse())

    @route("POST", "/v1/telemetry")
    async def telemetry(self, request: Request) -> dict:
        await self.body(request)  # bounded, then dropped: the SDK's telemetry stays on this machine, unread
        return as_json(types.TelemetryResponse(status="accepted"))

    @route("GET", "/v1/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @route("GET", "/v1/get_server_capabilities")
    async def capabilities(self, request: Request) -> dict:
        await self.callers.tenant(request)
        model = SupportedModel(
            model_name=self.settings.base_model,
            max_context_length=self.settings.max_context,
            trainable=True,
            sampleable=True,
        )
        return as_json(types.GetServerCapabilitiesResponse(supported_models=[model]))

    @route("POST", "/v1/create_session")
    async def create_session(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        await self.parse(request, types.CreateSessionRequest)
        return as_json(types.CreateSessionResponse(session_id=self.sessions.open(tenant.run)))

    @route("POST", "/v1/session_heartbeat")
    async def heartbeat(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.SessionHeartbeatRequest)
        try:
            self.sessions.heartbeat(body.session_id, tenant.run)
        except NotFound as exc:
            raise ApiError(410, str(exc)) from None
        return as_json(types.SessionHeartbeatResponse())

    @route("POST", "/v1/sessions/{session_id}/finish")
    async def finish_session(self, request: Request, session_id: str) -> dict:
        """The SDK's `close`. A session that is not open for the key (released after silence, or opened with a service
        that has since restarted) is finished already: the SDK's close succeeds, and nothing of anyone's is touched."""
        tenant = await self.callers.tenant(request)
        await self.body(request)
        try:
            released = self.sessions.close(session_id, tenant.run)
        except NotFound:
            return {}
        for model_id in released:
            await self.recovery.drop(model_id)
        return {}

    @route("POST", "/v1/admin/keys")
    async def create_key(self, request: Request) -> dict:
        """`POST /api/v1/admin/keys {"name", "lora_rank"}`: the admin makes a tenant (a run of the fleet), its key."""
        header = request.headers.get("authorization") or f"Bearer {request.headers.get('x-api-key', '')}"
        if self.admin_token is None or not token_matches(header, self.admin_token.value):
            raise ApiError(401, "creating an API key needs the fleet's admin token")
        require_json(request)  # as the fleet's admin calls: a web page cannot send it to 127.0.0.1
        body = await self.body(request)
        try:
            spec = pydantic.TypeAdapter(dict[str, Any]).validate_json(body or b"{}")
            name, rank = str(spec["name"]), spec.get("lora_rank")
        except (pydantic.ValidationError, KeyError) as exc:
            raise ApiError(400, f"expected {{'name': ..., 'lora_rank': ...}}: {exc}") from None
        try:
            key = await self.fleet.register(self.admin_token.value, name, rank)
        except FleetRefused as refused:
            raise ApiError(refused.status, refused.message) from None
        return {"name": name, "api_key": key}

    @route("POST", "/v1/retrieve_future")
    async def retrieve(self, request: Request) -> Response:
        tenant = await self.callers.tenant(request)
        body = await self.parse(request, types.FutureRetrieveRequest)
        if not self.futures.owned(body.request_id, tenant.run):
            raise ApiError(404, f"future {body.request_id[:80]!r} does not exist for this API key")
        outcome = await self.futures.wait(body.request_id, self.settings.poll_wait_s)
        if outcome is None:
            pending = TryAgainResponse(request_id=body.request_id, queue_state="active")
            return JSONResponse(as_json(pending))
        if isinstance(outcome, RequestFailed):
            category = types.RequestErrorCategory(outcome.category)
            return JSONResponse(as_json(types.RequestFailedResponse(error=outcome.message, category=category)))
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTOBUF)
        return JSONResponse(outcome.json)

    @route("POST", "/v1/cancel_future")
    async def cancel(self, request: Request) -> dict:
        tenant = await self.callers.tenant(request)
        body = await self.body(request)
        request_id = pydantic.TypeAdapter(dict[str, str]).validate_json(body or b"{}").get("request_id", "")
        if self.futures.owned(request_id, tenant.run):
            self.futures.cancel(request_id)
        return {}
