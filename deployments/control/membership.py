"""Replica membership: how many replicas the fleet is meant to have, and how many answer now.

Serve keeps the fleet at its configured size, bringing back a replica that died (a preempted node); the
live count is what answers a ping right now. `/server_info` reports the configured size (what the fleet
is), `/health` the live count (what it can do now), which `deployments.fleet.wait_healthy` waits on.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.control import Ping
from deployments.control.backend import Backend
from deployments.control.errors import ApiError


@dataclass(frozen=True)
class Membership:
    backend: Backend
    configured: int  # `fleet.num_replicas`

    async def live(self) -> int:
        """The replicas whose engine answers a ping; a 503 when none does."""
        live = [r for r in await self.backend.broadcast(Ping()) if not isinstance(r, BaseException)]
        if not live:
            raise ApiError(503, "no live replica")
        return len(live)
