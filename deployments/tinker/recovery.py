"""What a Tinker client has to lose when a learner goes, and how little it loses: the one owner of it.

A learner is lost with its node (a spot preemption; Ray starts it again elsewhere). A call that finds it gone waits
for it, up to `learner_wait_s`, so the client's future says `try_again` meanwhile (`run`); a learner that came back
without the client's adapter restores it from the client's last saved state first, then the call runs. On a spot
notice for a learner's node every client on it that changed since its last state is saved (`keep_everyone`), and from
then on after each of its steps (`after_training`), gradients not yet applied included: the learner Ray starts again
loses no step. Those saves are the service's own (no tinker path names them), each superseding the client's earlier
ones beyond the newest two (`PathRegistry.supersede`). Adapters that no session of this service holds (a service's
before it, lost with the head's node) are released (`drop_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from contracts.tinker import LearnerLost, TinkerBackend
from core.bucket.tinker_registry import PathRegistry
from deployments.tinker.callers import Callers
from deployments.tinker.fleet_calls import Tenant
from deployments.tinker.futures import RequestFailed
from deployments.tinker.sessions import Model, Sessions

log = logging.getLogger("ray.serve")

LEARNER_RETRY_S = 1.0  # how often a call waiting for a lost learner tries again

T = TypeVar("T")
Call = Callable[[TinkerBackend], Awaitable[T]]


class Recovery:
    """The learners' calls, riding out a lost learner, and the saves that make a loss cost nothing."""

    def __init__(self, learners: list[TinkerBackend], sessions: Sessions, callers: Callers, wait_s: float):
        self.learners, self.sessions, self.callers, self.wait_s = learners, sessions, callers, wait_s

    async def run(self, model: Model, tenant: Tenant, call: Call[T]) -> T:
        """`call` of `model`'s learner, which waits for a lost one and restores the client where it lost it."""
        return await self._run(model.learner, call, model, tenant)

    async def run_on(self, learner: int, call: Call[T]) -> T:
        """`call` of learner `learner` (a new client's, or one being replaced), which waits for a lost one."""
        return await self._run(learner, call, None, None)

    async def _run(self, index: int, call: Call[T], model: Model | None, tenant: Tenant | None) -> T:
        learner = self.learners[index]
        deadline = asyncio.get_running_loop().time() + self.wait_s
        restored = False
        while True:
            try:
                return await call(learner)
            except LearnerLost as lost:
                if asyncio.get_running_loop().time() > deadline:
                    raise RequestFailed(f"the learner is unavailable: {lost}", "server") from None
                await asyncio.sleep(LEARNER_RETRY_S)
            except KeyError as missing:
                if model is None or tenant is None or restored:
                    raise RequestFailed(str(missing), "user") from None
                await self._restore(learner, model, tenant)
                restored = True
            except ValueError as exc:
                raise RequestFailed(str(exc), "user") from None

    async def _restore(self, learner: TinkerBackend, model: Model, tenant: Tenant) -> None:
        """Put `model`'s adapter back on a learner that restarted without it, from the client's last saved state."""
        if model.saved is None:
            raise RequestFailed(
                f"the learner restarted and model {model.model_id} had no saved state (save_state) to resume from; "
                "create a training client again",
                "server",
            )
        log.info("tinker: restoring %s from its state %d after a learner restart", model.model_id, model.saved)
        lineage = await self.callers.lineage(tenant)
        await learner.load_state(model.model_id, lineage, model.saved, True, model.saved_from)
        model.restores += 1

    async def notice(self, learner: int) -> str | None:
        """The spot notice learner `learner`'s node has, in words; None without one, or with no learner to ask."""
        try:
            return await self.learners[learner].notice()
        except Exception:  # noqa: BLE001 - a learner that is gone has no notice; its calls wait for the next one
            return None

    async def after_training(self, model: Model, tenant: Tenant) -> None:
        """After a client's step or gradient: while its learner's node has a notice, save what it would lose."""
        if await self.notice(model.learner) is not None:
            await self.keep(model, tenant)

    async def keep(self, model: Model, tenant: Tenant) -> None:
        """Save `model`'s state (adapter, optimizer and a gradient not yet applied) as the one a restarted learner
        restores it from, unseen by the user's saved paths: after a spot notice, the learner Ray starts again elsewhere
        loses no step and no `forward_backward`."""
        lineage = await self.callers.lineage(tenant)
        number = await self.run(model, tenant, lambda learner: learner.save_state(model.model_id, lineage, True))
        model.saved, model.saved_from, model.trained = number, None, False
        await asyncio.to_thread(PathRegistry(lineage).supersede, model.model_id, number)

    async def keep_everyone(self, notice: str, learner: int = 0) -> None:
        """A spot notice for learner `learner`'s node: save each of its clients that trained since its last state."""
        for model in [m for m in self.sessions.models.values() if m.trained and m.learner == learner]:
            tenant = self.callers.keys.of(model.tenant)
            if tenant is None:
                continue
            try:
                await self.keep(model, tenant)
                log.warning("tinker: %s; %s saved, to be restored where it stopped", notice, model.model_id)
            except Exception as exc:  # noqa: BLE001 - the next optimizer step saves it again, while the notice lasts
                log.warning("tinker: %s; %s could not be saved: %s", notice, model.model_id, exc)

    async def keep_all_noticed(self) -> None:
        """`keep_everyone` for each learner whose node has a notice (the upkeep's round)."""
        for learner in range(len(self.learners)):
            notice = await self.notice(learner)
            if notice is not None:
                await self.keep_everyone(notice, learner)

    async def drop(self, model_id: str) -> None:
        """Release `model_id`'s adapter wherever it is (a no-op on the learners that do not hold it)."""
        for learner in self.learners:
            with contextlib.suppress(Exception):  # a learner that is gone holds nothing to drop
                await learner.drop(model_id)

    async def drop_orphans(self) -> None:
        """Drop the learners' adapters that no session of this service holds: a service started again (its node
        lost) knows none of the sessions before it, whose adapters would otherwise hold the learners' capacity."""
        for index, learner in enumerate(self.learners):
            try:
                held = await learner.models() or []
            except Exception:  # noqa: BLE001 - a learner that is gone holds nothing; the next round asks again
                continue
            mine = {m.model_id for m in self.sessions.models.values() if m.learner == index}
            for model_id in set(held) - mine:
                log.info("tinker: releasing %s (no session of this service holds it there)", model_id)
                with contextlib.suppress(Exception):
                    await learner.drop(model_id)
