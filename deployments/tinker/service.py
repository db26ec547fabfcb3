"""The Tinker API's app: what the unchanged `tinker` SDK calls under `/api/v1/`, answered with its own types.

The routes are split by job, as the fleet's (`deployments.api`): the `ServiceClient`'s sessions, keys and futures
(`session_routes`), a training client's calls (`training_routes`), a sampling client's (`sampling_routes`) and the
`RestClient`'s over saved paths (`checkpoint_routes`). They share who calls (`callers`), the learners' calls and what a
client has to lose when a learner goes (`recovery`), and the key's tinker paths in the bucket (`records`). Requests
are parsed with the SDK's request models or its protobuf (`wire`); long work (the learner's, the fleet's) is accepted
at once as a future (`futures`) and retrieved by id; refusals are the fleet's `ApiError` in the SDK's shape (`http`).

The app is independent of Ray: a learner is any `contracts.tinker.TinkerBackend` (`RayLearner` in Serve, a fake in the
unit tests) and the fleet is reached over HTTP (`FleetCalls`). With several learners (`learners`) each training client
lives on one of them, the one holding fewest when it was created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from contracts.auth import Secret
from contracts.tinker import TinkerBackend
from deployments.control.errors import ApiError
from deployments.tinker.callers import Callers, give_up_turn
from deployments.tinker.checkpoint_routes import CheckpointRoutes
from deployments.tinker.exports import ExportLinks
from deployments.tinker.fleet_calls import FleetCalls
from deployments.tinker.futures import Futures
from deployments.tinker.http import refusal
from deployments.tinker.limits import Limits
from deployments.tinker.paths import PathRefused
from deployments.tinker.records import TenantPaths
from deployments.tinker.recovery import Recovery
from deployments.tinker.routes import Parts
from deployments.tinker.sampling_routes import SamplingRoutes
from deployments.tinker.session_routes import SessionRoutes
from deployments.tinker.sessions import Sessions
from deployments.tinker.settings import TinkerSettings
from deployments.tinker.tenants import Tenants
from deployments.tinker.training_routes import TrainingRoutes

log = logging.getLogger("ray.serve")

UPKEEP_PERIOD_S = 5.0


class TinkerApi:
    """The service's state (sessions, keys, futures, export links) and its routes over it; `make_app` mounts them."""

    def __init__(
        self, settings: TinkerSettings, learners: list[TinkerBackend], fleet: FleetCalls, admin_token: Secret | None
    ):
        self.settings, self.learners, self.fleet = settings, learners, fleet
        self.sessions = Sessions(
            settings.max_models,
            settings.max_models_per_tenant,
            settings.session_idle_s,
            len(learners),
            max_samplers_per_tenant=settings.max_samplers_per_tenant,
            turn_wait_s=settings.turn_wait_s,
            max_seq_ahead=settings.max_seq_ahead,
        )
        self.keys = Tenants(fleet.tenant, self._revoked, settings.key_recheck_s)
        self.futures = Futures(settings.future_ttl_s)
        self.links = ExportLinks(admin_token, settings.cache_dir)
        self.callers = Callers(settings, self.keys, self.sessions, fleet)
        self.recovery = Recovery(learners, self.sessions, self.callers, settings.learner_wait_s)
        paths = TenantPaths(self.callers, self.sessions)
        parts = Parts(
            settings,
            self.callers,
            self.sessions,
            self.futures,
            self.recovery,
            paths,
            fleet,
            self.links,
            Limits.of(settings),
            admin_token,
        )
        self.sampling = SamplingRoutes(parts)
        self.routes = [SessionRoutes(parts), TrainingRoutes(parts), self.sampling, CheckpointRoutes(parts)]

    async def _revoked(self, run: str) -> None:
        """The fleet no longer knows run `run` (the admin removed it, or it went idle): its futures are cancelled, its
        sessions, samplers and training clients released, and what is cached of it forgotten."""
        self.futures.cancel_tenant(run)
        for model_id in self.sessions.close_tenant(run):
            await self.recovery.drop(model_id)
        self.fleet.forget(run)
        self.sampling.forget(run)

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
        """Release the sessions that went silent, and their adapters on the learner; on a spot notice for a learner's
        node, save its clients that trained since their last state (`Recovery`). Adapters on the learners that no
        session holds (a service's before this one) are released too. Every run that holds a session is kept alive on
        the fleet (`Tenants.keep_alive`), even one that only trains: first, so that no slow learner delays it."""
        in_session = {v.tenant for v in self.sessions.sessions.values()}
        await self.keys.keep_alive(in_session, self.fleet.heartbeat)
        self.keys.forget_idle(in_session, self.settings.session_idle_s)
        for model_id in self.sessions.take_idle():
            log.info("tinker: releasing %s (its session went silent)", model_id)
            await self.recovery.drop(model_id)
        await self.recovery.drop_orphans()
        await self.recovery.keep_all_noticed()
        await asyncio.to_thread(self.links.prune)


def make_app(
    settings: TinkerSettings,
    learners: list[TinkerBackend],
    admin_token: Secret | None = None,
    fleet: FleetCalls | None = None,
) -> FastAPI:
    """The FastAPI app of the Tinker API; its paths are `/v1/...` under Serve's route prefix `/api`
    (`contracts.tinker.TINKER_ROUTE_PREFIX`), which Serve takes off before the app sees a path. `fleet`: the fleet's
    HTTP API at `settings.fleet_url`, unless given."""
    fleet = fleet or FleetCalls(
        settings.fleet_url,
        settings.cache_dir,
        lane=settings.sample_lane,
        merge_window_s=settings.sample_merge_window_s,
        max_samples=settings.max_samples,
    )
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

    async def refused(request, exc: Exception):
        give_up_turn(request)  # a training client's claimed turn is taken all the same
        return refusal(exc)

    app.add_exception_handler(ApiError, refused)
    app.add_exception_handler(PathRefused, refused)
    for routes in api.routes:
        routes.register(app)
    return app
