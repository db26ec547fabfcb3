"""A replica's answer to a spot notice for its node: leave the router at once, hand unfinished work back in time.

On an interruption notice for its node (`contracts.notices`: the cloud's metadata, a scheduler's file, or Ray
draining the node, whoever drained it: Ray's own SIGTERM handler on `ray start`, another role's watcher on the
node, an operator), a replica on any node but the head (where the driver answers a notice for its own machine:
on the embedded default every replica runs there, and the driver's last step needs them)
- drains the node in Ray (`spot.drain_node`), so that Serve starts its replacement elsewhere first: Ray 2.60's
  controller moves the replicas of a draining node to PENDING_MIGRATION, starts as many new ones, and stops the
  old ones once those run, or when the deadline nears (`graceful_shutdown_timeout_s` before it). The replacement
  loads the live adapters before it takes traffic (`deployments.replica.warm_start`). A drain that Ray refuses, or that
  fails, drains this replica all the same;
- takes no new generation: it tells the ingress at once, whose routers then route nothing more to it
  (`deployments.routing.router`), and refuses what still arrives as `ReplicaDraining`, which the ingress sends to another
  replica;
- lets its generations in flight finish while there is time, and hands back those still running as soon as the
  replica is about to go (`deployments.replica.inflight`): `spot.handback_margin_s` before the deadline, or as Serve begins
  to stop it (its replacement runs), whichever comes first; the ingress continues each one on another replica,
  token-exact (`deployments.ingress.handback`);
- serves again if its node outlives the notice by `OUTLIVED_S` (a file notice removed, a maintenance that did not
  stop the machine, a drain Ray refused): the node was not taken after all, so the replica takes work again, tells
  the ingress so, and watches for the next notice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from contracts.notice_sources import RayDrain, watched_sources
from contracts.notice_watcher import NoticeWatcher
from contracts.notices import OUTLIVED_S, Notice, drain_this_node, on_head_node
from contracts.serving import ReplicaDraining
from deployments.replica.inflight import InFlight

log = logging.getLogger("ray.serve")

POLL_S = 0.5  # how often a draining replica looks whether its generations have all finished by themselves


class ReplicaNotices:
    """Replica `replica_id`'s notices: whether it still takes work, and its draining (`spot`: a `SpotConfig`).
    `tell_ingress(draining)` tells the ingress whether this replica drains; `stopping()` whether Serve has begun to
    stop it."""

    def __init__(
        self,
        replica_id: str,
        inflight: InFlight,
        spot,
        tell_ingress: Callable[[bool], Awaitable[None]] | None = None,
        stopping: Callable[[], Awaitable[bool]] | None = None,
    ):
        self.replica_id, self.inflight, self.spot, self.tell_ingress = replica_id, inflight, spot, tell_ingress
        self.stopping = stopping
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
        # Off the head node: a node of a cluster, `joined` for `spot.metadata`.
        sources = [*watched_sources(spot, joined=True), RayDrain(spot.sigterm_grace_s)]
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
            try:
                drain_this_node(notice)
            except Exception:  # noqa: BLE001 - Serve may not move it first now, but the replica drains regardless
                log.exception("replica %s: the node could not be drained in Ray; draining the replica", self.replica_id)
        self._draining = asyncio.run_coroutine_threadsafe(self.answer(notice), self._loop)

    async def answer(self, notice: Notice) -> None:
        """Drain for `notice`, then serve again if the node outlives it (a replica that goes with its node never
        gets that far)."""
        await self.drain(notice)
        await self._outlive(notice)

    async def drain(self, notice: Notice) -> None:
        """Leave the router, let the generations in flight finish while there is time, hand back the rest as the
        replica is about to go."""
        self.notice = notice
        log.warning("replica %s: %s; taking no new generation", self.replica_id, notice.describe())
        await self._tell(draining=True)
        loop = asyncio.get_running_loop()
        left = notice.remaining_s()
        until = loop.time() + max(0.0, (left if left is not None else 0.0) - self.spot.handback_margin_s)
        while self.inflight.requests and loop.time() < until and not await self._serve_stops_me():
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

    async def _outlive(self, notice: Notice) -> None:
        """Serve again once the node has outlived `notice` by `OUTLIVED_S`: it was not taken after all."""
        left = notice.remaining_s()
        await asyncio.sleep(max(0.0, (left if left is not None else 0.0) + OUTLIVED_S))
        if self.notice is not notice:
            return
        log.warning(
            "replica %s: the node outlived its %s notice by %.0f s: serving again",
            self.replica_id,
            notice.source,
            OUTLIVED_S,
        )
        self.notice = None
        if self._watcher is not None:
            self._watcher.clear(notice)
        await self._tell(draining=False)

    async def _serve_stops_me(self) -> bool:
        """Whether Serve has begun to stop this replica (its replacement runs): then it goes within Serve's
        graceful shutdown, and waiting for the deadline would lose its generations in flight."""
        if self.stopping is None:
            return False
        try:
            return await self.stopping()
        except Exception as e:  # noqa: BLE001 - the deadline still holds
            log.warning("replica %s: could not ask Serve whether it stops this replica: %r", self.replica_id, e)
            return False

    async def _tell(self, draining: bool) -> None:
        if self.tell_ingress is None:
            return
        try:
            await self.tell_ingress(draining)
        except Exception as e:  # noqa: BLE001 - the ingress learns it from the refusals (or their end) all the same
            log.warning(
                "replica %s: could not tell the ingress it %s: %r",
                self.replica_id,
                "drains" if draining else "serves again",
                e,
            )
