"""Who calls the Tinker API and what of theirs a request names: an API key's tenant, its sessions, training clients,
lineage and base model, each refused in the SDK's terms when the key may not reach it (another key's is not there).
"""

from __future__ import annotations

from fastapi import Request

from contracts.tinker import Lineage
from deployments.control.errors import ApiError
from deployments.tinker.fleet_calls import FleetCalls, FleetRefused, Tenant
from deployments.tinker.futures import RequestFailed
from deployments.tinker.sessions import Model, NotFound, Sampler, Sessions
from deployments.tinker.settings import TinkerSettings
from deployments.tinker.tenants import Tenants
from deployments.tinker.turns import TurnRefused


class Callers:
    """A request's tenant (its `X-API-Key`, through `Tenants`) and what it names of the tenant's."""

    def __init__(self, settings: TinkerSettings, keys: Tenants, sessions: Sessions, fleet: FleetCalls):
        self.settings, self.keys, self.sessions, self.fleet = settings, keys, sessions, fleet

    async def tenant(self, request: Request) -> Tenant:
        try:
            tenant = await self.keys.resolve(request.headers.get("x-api-key"))
        except FleetRefused as refused:
            raise ApiError(503, f"the fleet could not check the API key: {refused.message}") from None
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (X-API-Key: tml-<run token>; the admin creates keys)")
        return tenant

    def model(self, model_id: str, tenant: Tenant, seq_id: int | None = None, request: Request | None = None) -> Model:
        """The tenant's training client `model_id` (404 else); with `seq_id`, that number is claimed for `request`
        (`Turns.claim`): should the route then refuse it, its turn is given up (`give_up_turn`), since the SDK has
        used the number and a hole would hold every later request of the client."""
        try:
            model = self.sessions.model(model_id, tenant.run)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None
        if seq_id is not None:
            try:
                model.turns.claim(seq_id)
            except TurnRefused as refused:
                raise ApiError(refused.status, refused.message) from None
            if request is not None:
                request.state.turn = (model, seq_id)
        return model

    def session(self, session_id: str, tenant: Tenant) -> None:
        try:
            self.sessions.session(session_id, tenant.run)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None

    def sampler(self, sampler_id: str, tenant: Tenant) -> Sampler:
        try:
            return self.sessions.sampler(sampler_id, tenant.run)
        except NotFound as exc:
            raise ApiError(404, str(exc)) from None

    def base(self, base_model: str | None) -> str:
        """The base model a request names, by its id or its folder (or none): the one this server trains."""
        if base_model not in (self.settings.base_model, self.settings.model_path, None):
            raise ApiError(400, f"base_model {base_model!r}: this server trains {self.settings.base_model!r} only")
        return self.settings.base_model

    async def lineage(self, tenant: Tenant) -> Lineage:
        """The tenant's lineage (its prefix of the bucket, its signing key), for work in a future: a fleet that cannot
        say fails the request, as the server's."""
        try:
            return await self.fleet.lineage(tenant)
        except FleetRefused as refused:
            raise RequestFailed(f"the fleet has no lineage for run {tenant.run}: {refused.message}", "server") from None

    async def lineage_now(self, tenant: Tenant) -> Lineage:
        """`lineage`, from a route that answers at once: a fleet that cannot say is a 503."""
        try:
            return await self.lineage(tenant)
        except RequestFailed as failed:
            raise ApiError(503, failed.message) from None


def give_up_turn(request: Request) -> None:
    """A request refused after its training client's `seq_id` was claimed (`Callers.model`) still takes its turn,
    without running: the SDK numbered the client's later requests after it."""
    claimed = getattr(request.state, "turn", None)
    if claimed is not None:
        model, seq_id = claimed
        model.turns.give_up(seq_id)
