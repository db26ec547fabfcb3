"""Spot interruption notices: what one is, and what a role does with one in Ray.

A spot machine is taken back with a warning: AWS gives two minutes (IMDS `spot/instance-action`, and often
a rebalance recommendation earlier), GCP about 30 s (metadata `instance/preempted`, and
`instance/maintenance-event` before host maintenance), Kubernetes and SkyPilot a SIGTERM with a grace
period, and some schedulers write a file. Ray watches for none of these. Each is a `Notice`; the sources that
read them are `contracts.notice_sources`, and `contracts.notice_watcher` polls them in a thread of the process
that hosts a role (the learner, a replica, the driver) and calls that role's handlers once per notice: the node is
then drained in Ray (`drain_this_node`), the learner checkpoints, the replicas hand their work back (`app.spot`,
`app.learner.notices`, `deployments.replica.notices`).

Both sides need this (the learner's and the replicas' nodes are spot alike), so it sits below them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("spotrl.notices")

GCP_NOTICE_S = 30.0  # GCP's preemption notice; its maintenance notice is 60 s
GCP_MAINTENANCE_S = 60.0
# A node that outlives its deadline by this much was not taken after all: the roles on it carry on (the learner trains
# on rather than abandon every step, a replica takes work again) and watch for the next notice.
OUTLIVED_S = 60.0


@dataclass(frozen=True)
class Notice:
    """The machine will go away (or, `binding` False, a cloud recommends moving off it)."""

    source: str  # aws, aws-rebalance, gcp, gcp-maintenance, sigterm, file
    deadline: float | None  # unix seconds when the machine goes; None: not said
    detail: str = ""

    @property
    def binding(self) -> bool:
        """An interruption, not a recommendation: AWS's rebalance recommendation promises nothing."""
        return self.source != "aws-rebalance"

    @property
    def drains_node(self) -> bool:
        """Whether acting on it includes draining the node in Ray. Not for a SIGTERM to this process, which says the
        process ends, not the node: Ray itself sends one to the workers of a job that ends or an actor it kills, and
        a scheduler stopping the node signals Ray's own processes, whose handler drains it (`RayDrain` hears that).
        Not for Ray's drain either, which is under way already."""
        return self.binding and self.source not in ("sigterm", "ray-drain")

    def remaining_s(self, now: float | None = None) -> float | None:
        return None if self.deadline is None else self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        left = self.remaining_s()
        when = f", {left:.0f} s left" if left is not None else ""
        return f"{self.source} notice{when}{f' ({self.detail})' if self.detail else ''}"


def on_head_node() -> bool:
    """Whether this process runs on its Ray cluster's head node (False without Ray). The head is the cluster itself
    (its GCS, Serve's controller and proxy, the driver): on the embedded default everything runs there, and the
    driver answers a notice for that machine (`app.spot`); the roles on other nodes answer their own."""
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    node_id = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == node_id and "node:__internal_head__" in n.get("Resources", {}) for n in ray.nodes())


def drain_this_node(notice: Notice) -> bool:
    """Tell Ray that the node this process runs on is going (reason preemption, with the notice's deadline): nothing
    new is scheduled on it, and Serve starts replacements for its replicas elsewhere. False when Ray is not running
    here, on the head node (draining the cluster's own head would only stop the replicas there, with nowhere to
    start others, before the driver has checkpointed), or when Ray refused (it says why in the log); Ray's own
    SIGTERM handler makes the same call."""
    import ray

    if not ray.is_initialized() or on_head_node():
        return False
    from ray._private.worker import global_worker
    from ray.core.generated import autoscaler_pb2

    node_id = ray.get_runtime_context().get_node_id()
    deadline = notice.deadline if notice.deadline is not None else time.time() + GCP_NOTICE_S
    accepted, why = global_worker.gcs_client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"spotrl: {notice.describe()}",
        int(deadline * 1000),
    )
    if not accepted:
        log.warning("spot: Ray refused to drain node %s: %s", node_id[:12], why)
    else:
        log.warning("spot: node %s drained in Ray (%s)", node_id[:12], notice.describe())
    return bool(accepted)
