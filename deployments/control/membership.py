"""Replica membership: how many replicas answer now, and within which bounds the fleet may grow and shrink.

The fleet's size is not a constant: Serve brings back a replica that died (a preempted node), starts a
replacement before a noticed node goes, and with `fleet.autoscaling` grows and shrinks the fleet with its
load. What counts is what answers a ping right now: `/health` and `/server_info` report it, and the fair
share's budget follows it (`deployments.control.upkeep`); nothing reads the configured `num_replicas` once
the fleet runs. `deployments.fleet.wait_healthy` waits on `/health`.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.control import Ping
from deployments.control.backend import Backend
from deployments.control.errors import ApiError


@dataclass(frozen=True)
class Membership:
    backend: Backend
    bounds: tuple[int, int] | None = None  # (min_replicas, max_replicas) when the fleet autoscales

    async def live(self) -> int:
        """The replicas whose engine answers a ping; a 503 when none does."""
        live = [r for r in await self.backend.broadcast(Ping()) if not isinstance(r, BaseException)]
        if not live:
            raise ApiError(503, "no live replica")
        return len(live)

    def autoscaling(self) -> dict[str, int] | None:
        """`/server_info`'s bounds of an elastic fleet; None for a fleet of a fixed size."""
        return None if self.bounds is None else {"min_replicas": self.bounds[0], "max_replicas": self.bounds[1]}
