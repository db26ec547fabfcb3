"""Each tenant's own lane to the fleet: at most `size` of its sample requests in flight at once, whatever the others do.

Every tenant's samples leave the service through one HTTP client. Were they to share its bounded pool of
connections, one key's flood (an RL step's hundreds of sample futures) would queue every other key's samples in
this process, before the fleet's fair share (`deployments.control.fair_share`) ever saw them. So the pool is not the
bound; each key waits only behind its own requests here, and the fleet, which sees at most `size` of each key's at
once, decides between keys by their weights.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Lanes:
    """A semaphore of `size` places per tenant, made when it first samples and dropped when it holds none."""

    def __init__(self, size: int):
        self.size = size
        self._lanes: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}  # requests in or waiting for each lane: it is dropped at 0

    @contextlib.asynccontextmanager
    async def of(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of `tenant`'s places for the body (waiting, behind its own requests only, for one to be free)."""
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = asyncio.Semaphore(self.size)
        self._users[tenant] = self._users.get(tenant, 0) + 1
        try:
            async with lane:
                yield
        finally:
            self._users[tenant] -= 1
            if not self._users[tenant]:
                del self._users[tenant], self._lanes[tenant]

    def in_use(self, tenant: str) -> int:
        """`tenant`'s requests holding or waiting for a place."""
        return self._users.get(tenant, 0)
