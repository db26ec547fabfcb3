"""A replica's answer to a spot notice for its node: leave the router at once, hand unfinished work back in time.

On an interruption notice for its node (`contracts.notices`: the cloud's metadata, a scheduler's file, or Ray
draining the node, whoever drained it: Ray's own SIGTERM handler on `ray start`, another role's watcher on the
node, an operator), a replica on any node but the head (where the driver answers a notice for its own machine:
on the embedded default every replica runs there, and the driver's last step needs them)
- drains the node in Ray (`spot.drain_node`), so that Serve starts its replacement elsewhere first: Ray 2.60's
  controller moves the replicas of a draining node to PENDING_MIGRATION, starts as many new ones, and stops the
  old ones once those run, or when the deadline nears (`graceful_shutdown_timeout_s` before it). The replacement
  loads the live adapters before it takes traffic (`deployments.warm_start`);
- takes no new generation: it tells the ingress at once, whose routers then route nothing more to it
  (`deployments.router`), and refuses what still arrives as `ReplicaDraining`, which the ingress sends to another
  replica;
- lets its generations in flight finish while there is time, and hands back those still running
  `spot.handback_margin_s` before the deadline (`deployments.inflight`): the ingress continues each one on
  another replica, token-exact (`deployments.handback`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from contracts.notices import Notice, NoticeWatcher, RayDrain, cloud_sources, drain_this_node, on_head_node
from contracts.serving import ReplicaDraining
from deployments.inflight import InFlight

log = logging.getLogger("ray.serve")

POLL_S = 0.5  # how often a draining replica looks whether its generations have all finished by themselves


class ReplicaNotices:
    """Replica `replica_id`'s notices: whether it still takes work, and its draining (`spot`: a `SpotConfig`).
    `tell_ingress` says to the ingress that this replica is draining."""

    def __init__(
        self,
        replica_id: str,
        inflight: InFlight,
        spot,
        tell_ingress: Callable[[], Awaitable[None]] | None = None,
    ):
        self.replica_id, self.inflight, self.spot, self.tell_ingress = replica_id, inflight, spot, tell_ingress
        self.notice: Notice | None = None
        self.handed_back = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: NoticeWatcher | None = None
        self._draining: asyncio.Future | None = None

    def watch(self) -> ReplicaNotices:
        """Watch this replica's node from a thread; the draining runs on the calling (the replica's) event loop."""
        spot = self.spot
        if not spot.watch or on_head_node():
            return self
        self._loop = asyncio.get_running_loop()
        sources = [*cloud_sources(spot.probe_timeout_s), RayDrain(spot.sigterm_grace_s)]
        self._watcher = NoticeWatcher(
            [self._heard],
            interval_s=spot.poll_interval_s,
            probe_timeout_s=spot.probe_timeout_s,
            notice_file=spot.notice_file,
            sources=sources,
        ).start()
        return self

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    @property
    def draining(self) -> bool:
        return self.notice is not None

    def check_accepting(self) -> None:
        """A draining replica takes no new generation: the ingress sends it elsewhere."""
        if self.notice is not None:
            raise ReplicaDraining(
                f"replica {self.replica_id}: its node is going ({self.notice.describe()})", self.replica_id
            )

    def _heard(self, notice: Notice) -> None:
        """The watcher's thread: refuse new work at once, drain the node, then drain this replica on its loop."""
        if not notice.binding:
            log.warning("replica %s: %s; serving on until an interruption notice", self.replica_id, notice.describe())
            return
        self.notice = notice
        if self.spot.drain_node and notice.drains_node:
            drain_this_node(notice)
        self._draining = asyncio.run_coroutine_threadsafe(self.drain(notice), self._loop)

    async def drain(self, notice: Notice) -> None:
        """Leave the router, let the generations in flight finish while there is time, hand back the rest."""
        self.notice = notice
        log.warning("replica %s: %s; taking no new generation", self.replica_id, notice.describe())
        if self.tell_ingress is not None:
            try:
                await self.tell_ingress()
            except Exception as e:  # noqa: BLE001 - the ingress learns it from the refusals all the same
                log.warning("replica %s: could not tell the ingress it drains: %r", self.replica_id, e)
        loop = asyncio.get_running_loop()
        left = notice.remaining_s()
        until = loop.time() + max(0.0, (left if left is not None else 0.0) - self.spot.handback_margin_s)
        while self.inflight.requests and loop.time() < until:
            await asyncio.sleep(min(POLL_S, max(0.0, until - loop.time())))
        if self.inflight.requests:
            self.handed_back += await self.inflight.hand_back()
            remaining = notice.remaining_s()
            log.warning(
                "replica %s: handed %d unfinished generations back to the ingress%s",
                self.replica_id,
                self.handed_back,
                f", {remaining:.0f} s before the node goes" if remaining is not None else "",
            )
