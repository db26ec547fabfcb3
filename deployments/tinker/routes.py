"""What every Tinker route class shares: the service's parts (`Parts`), and reading a body within the service's bound;
routes are registered as the fleet's are (`deployments.api.routing.Routes`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from contracts.auth import Secret
from deployments.api.routing import Routes
from deployments.tinker.callers import Callers
from deployments.tinker.exports import ExportLinks
from deployments.tinker.fleet_calls import FleetCalls
from deployments.tinker.futures import Futures
from deployments.tinker.http import Model, parse, read
from deployments.tinker.limits import Limits
from deployments.tinker.records import TenantPaths
from deployments.tinker.recovery import Recovery
from deployments.tinker.sessions import Sessions
from deployments.tinker.settings import TinkerSettings


@dataclass(frozen=True)
class Parts:
    """The service's state and helpers, one of each, that its routes work with."""

    settings: TinkerSettings
    callers: Callers
    sessions: Sessions
    futures: Futures
    recovery: Recovery
    paths: TenantPaths
    fleet: FleetCalls
    links: ExportLinks
    limits: Limits
    admin_token: Secret | None


class TinkerRoutes(Routes):
    """A class of Tinker routes over the service's `Parts`; each reads its body within `max_body_bytes`."""

    def __init__(self, parts: Parts):
        p = parts
        self.settings, self.callers, self.sessions, self.futures = p.settings, p.callers, p.sessions, p.futures
        self.recovery, self.paths, self.fleet, self.links = p.recovery, p.paths, p.fleet, p.links
        self.limits, self.admin_token = p.limits, p.admin_token

    async def body(self, request: Request) -> bytes:
        return await read(request, self.settings.max_body_bytes)

    async def parse(self, request: Request, model: type[Model]) -> Model:
        return await parse(request, model, self.settings.max_body_bytes)
