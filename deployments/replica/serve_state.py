"""What Serve's controller says of a replica: whether it has begun to stop it.

Serve gives a replica no word when it starts to stop it: its graceful shutdown waits for the requests in flight
(at most `graceful_shutdown_timeout_s`) and calls `__del__` only after that. A replica whose node is going must
hand its generations back before it goes (`deployments.replica.notices`), and Serve stops it as soon as its
replacement runs, which may be long before the notice's deadline: so the replica asks the controller, whose view
of every replica (state `STOPPING` among them) is what `serve status` and the dashboard show
(`ray.serve.schema.ServeInstanceDetails`).
"""

from __future__ import annotations

STOPPING = "STOPPING"


def replica_state(details: dict, replica_id: str) -> str | None:
    """The state of replica `replica_id` in the controller's `ServeInstanceDetails` (a dict), None if not listed."""
    for app in (details.get("applications") or {}).values():
        for deployment in (app.get("deployments") or {}).values():
            for replica in deployment.get("replicas") or []:
                if replica.get("replica_id") == replica_id:
                    state = replica.get("state")
                    return str(getattr(state, "value", state))  # a `ReplicaState`, or its value
    return None


async def serve_stops(replica_id: str) -> bool:
    """Whether Serve's controller is stopping replica `replica_id` (False when no controller answers)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return False
    details = await client._controller.get_serve_instance_details.remote()
    return replica_state(details, replica_id) == STOPPING
