"""The Tinker API as a Ray Serve application beside the fleet's, at route prefix `/api`.

`TINKER_BASE_URL` is then the fleet's own address: the SDK's paths (`/api/v1/...`) reach this application and every
other path the fleet's ingress. One replica, on the head node like the ingress: it holds the sessions and futures.

The fleet's front door (`deployments.ingress.front_door`) hands `/api` to Serve's proxy, whose path costs about 11 ms of
CPU a request, and the cookbook's loops send one sample request (and its future's polls) per sequence. So this replica
opens a door of its own on loopback and announces it to the fleet's ingress (`Ingress.open_door`), again every
`ANNOUNCE_EVERY_S` while it lives; the fleet's door then forwards `/api` there in one loopback hop. If the
announcements stop (this replica died), the fleet's door goes back to Serve's proxy after `DOOR_TTL_S`.
"""

from __future__ import annotations

import asyncio
import logging

from contracts.auth import Secret
from contracts.serving import INGRESS_DEPLOYMENT
from contracts.tinker import TINKER_ROUTE_PREFIX, learner_name
from core.config import HEAD_NODE
from deployments.ingress.front_door import FrontDoor
from deployments.tinker.learner_handle import RayLearner
from deployments.tinker.service import make_app
from deployments.tinker.settings import TinkerSettings

log = logging.getLogger("ray.serve")

DEPLOYMENT = "TinkerService"
ANNOUNCE_EVERY_S = 10.0
DOOR_TTL_S = 30.0


class TinkerService:
    """A Ray Serve deployment class around `make_app`; the learners are the named actors (`RayLearner`)."""

    def __init__(self, settings: dict, admin_token: Secret | None = None, learners: list | None = None):
        parsed = TinkerSettings.model_validate(settings)
        handles = learners or [None] * parsed.learners
        learners = [RayLearner(handle, learner_name(i)) for i, handle in enumerate(handles)]
        self._app = make_app(parsed, learners, admin_token)
        self._door = FrontDoor(self._app, "127.0.0.1", 0, max_connections=1000, route_prefix=TINKER_ROUTE_PREFIX)
        self._loop = asyncio.get_running_loop()
        self._announcing = self._loop.create_task(self._announce(parsed.fleet_app))

    def __serve_build_asgi_app__(self):
        return self._app

    async def _announce(self, fleet_app: str) -> None:
        """Tell the fleet's ingress where this replica's door is, while it lives (a replaced ingress learns it anew)."""
        from ray import serve

        url = await self._door.opened(wait_s=None)
        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, fleet_app)
        while True:
            try:
                await ingress.open_door.remote(TINKER_ROUTE_PREFIX, url, DOOR_TTL_S)
            except Exception as e:  # the fleet's ingress restarting: its door uses Serve's proxy meanwhile
                log.warning("Tinker service: the fleet's ingress did not take this door (%s: %s)", type(e).__name__, e)
            await asyncio.sleep(ANNOUNCE_EVERY_S)

    def __del__(self):
        if getattr(self, "_door", None) is not None:  # going: no more announcements of a door that closes
            self._door.stop()
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._announcing.cancel)


def tinker_app(settings: TinkerSettings, admin_token: Secret | None, learners: list | None = None):
    """The Serve application (not yet running); `learners` are the learner actors' handles (None: look them up by
    name)."""
    from ray import serve

    deployment = serve.deployment(
        serve.ingress()(TinkerService),
        name=DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0, "resources": dict(HEAD_NODE)},
        logging_config={"enable_access_log": False},
    )
    return deployment.bind(settings.model_dump(), admin_token, learners)
