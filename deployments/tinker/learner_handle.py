"""The learner actor as the HTTP side reaches it: by name, over Ray, in `contracts.tinker`'s messages.

The actor (`app/learner/tinker_learner.py`) is started by `launch/tinker.py`; this side only looks it up
(`LEARNER_ACTOR` in `LEARNER_NAMESPACE`) and awaits its calls, so that `deployments/` never imports `app/`. A learner
that is gone (its node preempted, its process killed) is `LearnerLost`; what the learner refused as sent (a
`ValueError`, a `KeyError` for a model it does not hold) stays that type, for the service to answer as the user's.
"""

from __future__ import annotations

from typing import Any

from contracts.tinker import LEARNER_ACTOR, LEARNER_NAMESPACE, LearnerLost


class RayLearner:
    """Calls the named learner actor: `await learner.call("forward_backward", LossCall(...))`."""

    def __init__(self, actor=None, name: str = LEARNER_ACTOR, namespace: str = LEARNER_NAMESPACE):
        self._actor, self.name, self.namespace = actor, name, namespace

    def _handle(self):
        """The handle `launch/tinker.py` passed in, else the named actor (one started again after a loss)."""
        import ray

        if self._actor is not None:
            return self._actor
        try:
            return ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            raise LearnerLost(f"the learner actor {self.name} is not running") from None

    async def call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        actor = self._handle()
        try:
            return await getattr(actor, method).remote(*args)
        except RayActorError as exc:
            raise LearnerLost(f"the learner died during {method}: {type(exc).__name__}") from None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, LearnerLost):  # a learner group whose rank died: it started its ranks again
                raise LearnerLost(str(cause)) from None
            if isinstance(cause, ValueError | KeyError):
                raise type(cause)(*cause.args) if isinstance(cause, KeyError) else ValueError(str(cause)) from None
            raise RuntimeError(f"{method}: {type(cause).__name__}: {cause}") from None
