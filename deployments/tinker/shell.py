"""The Tinker API as a Ray Serve application beside the fleet's: same HTTP proxy, route prefix `/api`.

`TINKER_BASE_URL` is then the fleet's own address: the SDK's paths (`/api/v1/...`) reach this application and every
other path the fleet's ingress. One replica, on the head node like the ingress: it holds the sessions and futures.
"""

from __future__ import annotations

from contracts.auth import Secret
from contracts.tinker import learner_name
from core.config import HEAD_NODE
from deployments.tinker.learner_handle import RayLearner
from deployments.tinker.service import make_app
from deployments.tinker.settings import TinkerSettings

DEPLOYMENT = "TinkerService"


class TinkerService:
    """A Ray Serve deployment class around `make_app`; the learners are the named actors (`RayLearner`)."""

    def __init__(self, settings: dict, admin_token: Secret | None = None, learners: list | None = None):
        parsed = TinkerSettings.model_validate(settings)
        handles = learners or [None] * parsed.learners
        learners = [RayLearner(handle, learner_name(i)) for i, handle in enumerate(handles)]
        self._app = make_app(parsed, learners, admin_token)

    def __serve_build_asgi_app__(self):
        return self._app


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
