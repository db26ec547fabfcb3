"""The learner actor as the HTTP side reaches it: by name, over Ray, as a `contracts.tinker.TinkerBackend`.

The actor (`app/learner/tinker_learner.py`) is started by `launch/tinker.py`; this side only looks it up
(`LEARNER_ACTOR` in `LEARNER_NAMESPACE`) and awaits its calls, so that `deployments/` never imports `app/`. A learner
that is gone (its node preempted, its process killed) is `LearnerLost`; what the learner refused as sent (a
`ValueError`, a `KeyError` for a model it does not hold) stays that type, for the service to answer as the user's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from contracts.tinker import (
    LEARNER_ACTOR,
    LEARNER_NAMESPACE,
    AdamStep,
    AdapterSpec,
    Export,
    LearnerLost,
    Lineage,
    LossCall,
    LossReply,
    Publication,
    StepReply,
)


class RayLearner:
    """The named learner actor, each of its methods awaited under its own name: `await learner.forward_backward(call)`
    runs `TinkerLearner.forward_backward(call)` in the actor."""

    def __init__(self, actor=None, name: str = LEARNER_ACTOR, namespace: str = LEARNER_NAMESPACE):
        self._actor, self.name, self.namespace = actor, name, namespace

    async def create(self, model: str, spec: AdapterSpec) -> None:
        await self._run("create", lambda actor: actor.create.remote(model, spec))

    async def drop(self, model: str) -> bool:
        return await self._run("drop", lambda actor: actor.drop.remote(model))

    async def models(self) -> list[str]:
        return await self._run("models", lambda actor: actor.models.remote())

    async def notice(self) -> str | None:
        return await self._run("notice", lambda actor: actor.notice.remote())

    async def forward_backward(self, call: LossCall) -> LossReply:
        return await self._run("forward_backward", lambda actor: actor.forward_backward.remote(call))

    async def optim_step(self, step: AdamStep) -> StepReply:
        return await self._run("optim_step", lambda actor: actor.optim_step.remote(step))

    async def publish(self, model: str, lineage: Lineage) -> Publication:
        return await self._run("publish", lambda actor: actor.publish.remote(model, lineage))

    async def adopt(self, lineage: Lineage, source: str, version: int, source_key: str) -> Publication:
        return await self._run("adopt", lambda actor: actor.adopt.remote(lineage, source, version, source_key))

    async def save_state(self, model: str, lineage: Lineage, gradient: bool) -> int:
        return await self._run("save_state", lambda actor: actor.save_state.remote(model, lineage, gradient))

    async def export(self, model: str, lineage: Lineage) -> Export:
        return await self._run("export", lambda actor: actor.export.remote(model, lineage))

    async def load_state(
        self, model: str, lineage: Lineage, number: int, optimizer: bool, source: str | None
    ) -> AdapterSpec:
        return await self._run(
            "load_state", lambda actor: actor.load_state.remote(model, lineage, number, optimizer, source)
        )

    def _handle(self):
        """The handle `launch/tinker.py` passed in, else the named actor (one started again after a loss)."""
        import ray

        if self._actor is not None:
            return self._actor
        try:
            return ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            raise LearnerLost(f"the learner actor {self.name} is not running") from None

    async def _run(self, what: str, start: Callable[[Any], Any]) -> Any:
        """Await the call `start(actor)` made, its failures in the service's terms (`what` names it in them)."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await start(self._handle())
        except RayActorError as exc:
            raise LearnerLost(f"the learner died during {what}: {type(exc).__name__}") from None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, LearnerLost):  # a learner group whose rank died: it started its ranks again
                raise LearnerLost(str(cause)) from None
            if isinstance(cause, ValueError | KeyError):
                raise type(cause)(*cause.args) if isinstance(cause, KeyError) else ValueError(str(cause)) from None
            raise RuntimeError(f"{what}: {type(cause).__name__}: {cause}") from None
