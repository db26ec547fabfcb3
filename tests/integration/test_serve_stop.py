"""Serve's graceful stop of a replica, as the replica sees it (`deployments.replica.serve_state`): a real Ray Serve on
loopback, a deployment whose request waits until its replica learns from the controller that it is being stopped.

A draining replica hands its generations back as soon as Serve starts to stop it (`deployments.replica.notices`):
this is the signal it waits for, and it must come while the stopping replica still answers its requests."""

from __future__ import annotations

import time

import pytest


class Stoppable:
    """A replica whose request waits until Serve stops the replica, and says after how long it heard."""

    def __init__(self, generation: int):
        self.generation = generation

    async def __call__(self) -> dict:
        import asyncio

        from ray import serve

        from deployments.replica.serve_state import serve_stops

        replica_id = serve.get_replica_context().replica_id.unique_id
        started = time.monotonic()
        while not await serve_stops(replica_id):
            await asyncio.sleep(0.2)
            if time.monotonic() - started > 120:
                return {"heard": False, "generation": self.generation}
        return {"heard": True, "after_s": time.monotonic() - started, "generation": self.generation}


@pytest.fixture(scope="module")
def serve_on_loopback():
    import ray
    from ray import serve

    from tests.support.fleet_helpers import start_local_ray

    start_local_ray(num_cpus=2)
    serve.start(http_options={"host": "127.0.0.1", "port": 0}, proxy_location="Disabled")
    yield serve
    serve.shutdown()
    ray.shutdown()


def test_a_replica_hears_from_the_controller_that_serve_stops_it_while_its_request_still_runs(serve_on_loopback):
    """As on a draining node: Serve starts the replacement first and stops the old replica once it runs (here a
    new version of the deployment, which Serve rolls out the same way); the old one's request hears it at once."""
    serve = serve_on_loopback
    deployment = serve.deployment(Stoppable, name="Stoppable", graceful_shutdown_timeout_s=60)
    handle = serve.run(deployment.bind(1), name="stoppable", route_prefix=None)
    reply = handle.remote()
    time.sleep(2.0)  # the request runs on a RUNNING replica: not stopping
    replaced_at = time.monotonic()
    serve.run(deployment.bind(2), name="stoppable", route_prefix=None)  # returns once it runs
    answer = reply.result(timeout_s=90)
    heard_s = time.monotonic() - replaced_at
    assert answer["heard"] and answer["generation"] == 1 and answer["after_s"] >= 2.0, answer
    assert heard_s < 30.0, f"heard {heard_s:.1f} s after the replacement was asked for"
    serve.delete("stoppable")
