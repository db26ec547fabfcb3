"""An elastic fleet: Ray Serve's autoscaling of the replicas, on the sequences they have in flight.

Serve's default policy counts requests, but a request is one prompt of `n` samples, and what loads an engine is
sequences: each replica reports its own, running or waiting in its engine (`VLLMReplica.record_autoscaling_stats`,
`deployments.replica.inflight`), and `SequencesPolicy` asks for `sum / fleet.autoscaling.target_sequences` replicas, plus
the requests queued in the handles. The rollouts' backlog beyond what the engines take waits in the ingress's
fair-share gate, which Serve does not see: when every replica's engine is full (`fleet.max_num_seqs`), the
policy asks for one more replica. Serve applies the delays (`upscale_delay_s`, `downscale_delay_s`) and the
bounds (`min_replicas`, `max_replicas`); Ray's autoscaler brings a node when a new replica finds no room
(cluster.yaml's rollout groups). A replica added mid-run loads the pinned adapters before it takes traffic
(`deployments.replica.warm_start`), and the router, the gate's budget and `/server_info` follow the live replicas
(`deployments.control.upkeep`).

Serve pickles the policy by value into its controller: this module imports nothing of ours at import time.
"""

from __future__ import annotations

import math
from typing import Any

SEQUENCES_METRIC = "sequences"  # what each replica reports (`VLLMReplica.record_autoscaling_stats`)
POLICY = "deployments.autoscaling:SequencesPolicy"


class SequencesPolicy:
    """Replicas for the sequences in flight, `target` per replica; one more when every engine holds `full`."""

    def __init__(self, target: float, full: int):
        self.target, self.full = target, full

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        reported = (ctx.aggregated_metrics or {}).get(SEQUENCES_METRIC) or {}
        if not reported:  # nothing measured yet: stay
            return ctx.target_num_replicas, {}
        return desired_replicas(list(reported.values()), ctx.total_queued_requests or 0.0, self.target, self.full), {}


def desired_replicas(sequences: list[float], queued: float, target: float, full: int) -> int:
    """Replicas for `sequences` in flight on each replica that reported and `queued` requests not yet routed."""
    desired = math.ceil((sum(sequences) + queued) / target)
    if sequences and all(s >= full for s in sequences):  # the engines are full: the backlog waits in the gate
        desired = max(desired, len(sequences) + 1)
    return desired


def autoscaling_config(fleet) -> dict[str, Any] | None:
    """Serve's `autoscaling_config` of the replica deployment for `fleet` (`FleetSettings`); None: a fixed size."""
    scaling = fleet.autoscaling
    if scaling is None:
        return None
    return {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": fleet.num_replicas,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
        "policy": {
            "policy_function": POLICY,
            "policy_kwargs": {"target": scaling.target_sequences, "full": fleet.max_num_seqs},
        },
    }
