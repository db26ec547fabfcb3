"""Starts the Tinker API beside a running fleet: the learner actor (`app/`) and the Serve application (`deployments/`).

It sits in `launch/` because it is the one place that wires the two products together: the learner's class is the
run side's (`app.learner.tinker_learner.TinkerLearner`), the HTTP service is the fleet's (`deployments.tinker`), and
they meet only as a named actor and `contracts.tinker`'s messages. Afterwards `TINKER_BASE_URL` is the fleet's URL.
"""

from __future__ import annotations

from contracts.auth import Secret
from contracts.tinker import LEARNER_ACTOR, LEARNER_NAMESPACE, TINKER_APP, TINKER_ROUTE_PREFIX
from deployments.tinker.settings import TinkerSettings


def start_tinker(settings: TinkerSettings, admin_token: str | None, num_cpus: float = 0) -> str:
    """Start the learner actor and the Serve application on the connected Ray; returns the base URL for the SDK."""
    import ray
    from ray import serve

    from app.learner.tinker_learner import TinkerLearner
    from deployments.tinker.shell import tinker_app

    # A learner whose process dies (its node preempted, a crash) is started again by Ray with the base model alone;
    # the service restores each client from its last saved state on its next call (`TinkerApi._learner`).
    learner = (
        ray.remote(TinkerLearner)
        .options(name=LEARNER_ACTOR, namespace=LEARNER_NAMESPACE, num_cpus=num_cpus, max_restarts=-1)
        .remote(settings.model_path, settings.max_models)
    )
    ray.get(learner.models.remote())  # up, with the base model loaded
    serve.run(
        tinker_app(settings, Secret(admin_token) if admin_token else None, learner),
        name=TINKER_APP,
        route_prefix=TINKER_ROUTE_PREFIX,
    )
    return settings.fleet_url


def stop_tinker() -> None:
    import ray
    from ray import serve

    serve.delete(TINKER_APP)
    try:
        ray.kill(ray.get_actor(LEARNER_ACTOR, namespace=LEARNER_NAMESPACE))
    except ValueError:
        pass
