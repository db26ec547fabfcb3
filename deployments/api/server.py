"""The fleet's FastAPI app, put together: the routes of every job over one control layer, and its error replies.

The app is independent of Ray: a `Backend` does the generating and broadcasting, so its parsing, auth and
error handling are unit-tested with a fake backend; `deployments.ingress.shell` plugs in Ray Serve. While the app
serves (its lifespan), the control layer's upkeep runs beside it (`deployments.control.upkeep`).

Errors: a malformed request gets 400 with the reason, an unknown model 404, a missing or wrong
token 401, a body over `fleet.max_request_bytes` 413 (by its Content-Length, without waiting for
it), an admin call whose body is not declared JSON 415; messages never carry the token, and the
bucket's `redact` strips credentials from URLs. No request may crash, stall or open the fleet: what
a body may hold is bounded in `deployments.api.bodies`, and the CPU work of a request (parsing,
tokenizing, decoding) runs in a few worker threads (`offload`), never on the event loop that answers
every other request, `/health` included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from deployments.api.admin_routes import AdminRoutes
from deployments.api.callers import Callers
from deployments.api.inference_routes import InferenceRoutes
from deployments.api.replies import FiniteJSONResponse
from deployments.api.routing import Routes
from deployments.api.run_routes import RunRoutes
from deployments.api.settings import ApiSettings
from deployments.api.status_routes import StatusRoutes
from deployments.control.backend import Backend
from deployments.control.errors import ApiError, Scrub, as_api_error
from deployments.control.fair_share import FairShare
from deployments.control.membership import Membership
from deployments.control.runs import Runs
from deployments.control.tenancy import Tenancy
from deployments.control.upkeep import Upkeep

log = logging.getLogger("ray.serve")

WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="spotrl", Basic realm="spotrl"'}


@dataclass(frozen=True)
class RouteParts:
    """What a fleet's own routes (`fleet.routes`) are made from: the app's settings and its control layer's objects,
    the ones the shipped routes share."""

    settings: ApiSettings
    callers: Callers
    backend: Backend
    gate: FairShare
    runs: Runs
    membership: Membership
    scrub: Scrub


def make_app(
    backend: Backend,
    settings: ApiSettings,
    runs: Runs | None = None,
    records=None,
    gate: FairShare | None = None,
    own_lineage: Callable[[], bool] | None = None,
    routes: Sequence[Callable[[RouteParts], Routes]] = (),
) -> FastAPI:
    """The FastAPI app of the fleet, over any `Backend`; `runs` is the registry of its tenants, `records` (an
    `core.bucket.records.RunRecords`) where registrations are kept across restarts of the ingress, `gate` the fair
    share of in-flight sequences between them, `own_lineage` whether the fleet's own lineage has a committed version
    (`deployments.control.tenancy`), `routes` more routes of one's own (`fleet.routes`), beside the shipped ones
    and never in their place. `app.state.upkeep` is its background upkeep."""
    scrub = Scrub(settings.admin_token)
    runs = runs if runs is not None else Runs.of(settings)
    gate = gate if gate is not None else FairShare(settings.inflight_budget, runs.weight, is_run=runs.__contains__)
    tenancy = Tenancy(runs, records, backend, scrub, gate, own_lineage)
    membership = Membership(backend, settings.autoscaling)
    upkeep = Upkeep(tenancy, backend, gate, membership, settings.inflight_per_replica)
    app = FastAPI(
        title="spotrl fleet",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=FiniteJSONResponse,
        lifespan=upkeep.lifespan,
    )
    app.state.upkeep = upkeep
    replies = ErrorReplies(scrub)
    app.add_exception_handler(ApiError, replies.api_error)
    app.add_exception_handler(Exception, replies.unexpected)
    callers = Callers(settings.admin_token, runs, settings.protect_inference)
    shipped = (
        InferenceRoutes(settings, callers, backend, gate, scrub),
        StatusRoutes(settings, callers, backend, membership, gate, runs),
        AdminRoutes(callers, backend, settings.limits),
        RunRoutes(callers, tenancy, settings.limits, settings.signing),
    )
    parts = RouteParts(settings, callers, backend, gate, runs, membership, scrub)
    own = [factory(parts) for factory in routes]
    taken = {(verb, path) for group in shipped for verb, path, _ in group.handlers()}
    for group in own:
        for verb, path, _ in group.handlers():
            if (verb, path) in taken:  # the first route that matches answers: it would never be reached, or shadow
                raise ValueError(f"fleet.routes: {type(group).__name__} answers {verb} {path}, which the fleet does")
            taken.add((verb, path))
    for group in (*shipped, *own):
        group.register(app)
    return app


class ErrorReplies:
    """Every error as `{"error": {...}}`, with the token and bucket credentials scrubbed from the message."""

    def __init__(self, scrub: Callable[[str], str]):
        self.scrub = scrub

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
