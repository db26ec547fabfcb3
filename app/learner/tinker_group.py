"""The Tinker learner over several devices: one named actor that drives N `TinkerLearner` ranks sharding one base.

A Tinker training client's calls come to one named actor (`contracts.tinker.LEARNER_ACTOR`) one at a time. With
`learner_ranks` above 1 (`launch/tinker.py`) that actor is this group: it starts N rank actors (each a
`TinkerLearner` with its rank, one GPU each on CUDA, packed on one node), joins them in one process group that
shards the frozen base (FSDP2), and hands every call to the ranks that must take part (`app.learner.rank_group`,
as the run learner's `LearnerGroup` does). Calls that compute (`create`, `forward_backward`, `optim_step`, `load_state`, `drop`) go to
every rank in the same order, since they run collectives; calls that write or read the bucket go to rank 0 alone,
which holds the same adapters and optimizer as every other rank.

A rank that dies (its node preempted or lost) leaves the others stuck in a collective, so the group starts all of
them again, with the base model alone, and answers the call with `LearnerLost`: the service then waits and retries,
finds the client's adapter gone and restores it from the client's last saved state, as it does when the single
learner actor restarts. A spot notice is heard by each rank's own watcher (`TinkerLearner.notice`), which drains its
node so that the ranks' replacements start elsewhere.
"""

from __future__ import annotations

import logging
import random

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from app.learner.rank_group import RankGroup
from app.learner.tinker_learner import TinkerLearner
from contracts.tinker import AdapterSpec, LearnerLost

log = logging.getLogger(__name__)

SETTLE_S = 30.0  # how long the other ranks get to fail alike after one rank refused a call (a bad input)


class TinkerLearnerGroup:
    """`ranks` TinkerLearner ranks behind the methods of one: the service cannot tell the two apart."""

    def __init__(
        self,
        model_path: str,
        max_models: int = 8,
        spot=None,
        device: str = "cpu",
        dtype: str = "float32",
        ranks: int = 2,
        cpus_per_rank: float = 1.0,
    ):
        if ranks < 2:
            raise ValueError(f"ranks {ranks}: a group has at least 2 (one device is a TinkerLearner alone)")
        gpus = 1 if device == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        learner_args = (model_path, max_models, spot, device, dtype)
        self.restarts = 0
        self._ranks = RankGroup(
            TinkerLearner,
            lambda rank: (*learner_args, rank, ranks),
            [bundle] * ranks,
            max_restarts=0,  # the group restarts every rank together: a lone restarted rank has no peers
            what="tinker learner",
        )

    # ---- the ranks --------------------------------------------------------------------------------------

    def _restart(self, why: str) -> None:
        log.warning("tinker learner: %s; starting all %d ranks again", why, len(self._ranks.actors))
        self.restarts += 1
        self._ranks.replace()

    def _all(self, method: str, *args):
        """`method` on every rank, in the same order on each; rank 0's answer."""
        refs = self._ranks.call(method, *args)
        try:
            RankGroup.wait(refs)
        except RayActorError as exc:
            self._restart(f"a rank died during {method} ({type(exc).__name__})")
            raise LearnerLost(f"a learner rank died during {method}; the ranks were started again") from None
        except RayTaskError as exc:
            # A bad input is refused by every rank alike before any collective; anything else may have left the
            # others waiting in one, and then only a restart frees them.
            settled, _ = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_S)
            if len(settled) < len(refs) or not isinstance(exc.cause, ValueError | KeyError):
                self._restart(f"a rank failed in {method}: {type(exc.cause).__name__}")
            raise exc.cause from None
        return ray.get(refs[0])

    def _rank0(self, method: str, *args):
        """`method` on rank 0 alone: a bucket write or read, no collective."""
        try:
            return self._ranks.rank0(method, *args)
        except RayActorError as exc:
            self._restart(f"rank 0 died during {method} ({type(exc).__name__})")
            raise LearnerLost(f"learner rank 0 died during {method}; the ranks were started again") from None
        except RayTaskError as exc:
            raise exc.cause from None

    # ---- what the service calls -----------------------------------------------------------------------

    def create(self, model: str, spec: AdapterSpec) -> None:
        # One seed for every rank: their replicas of the adapter must start equal.
        return self._all("create", model, spec, spec.seed if spec.seed is not None else random.getrandbits(62))

    def drop(self, model: str) -> bool:
        return self._all("drop", model)

    def forward_backward(self, call):
        return self._all("forward_backward", call)

    def optim_step(self, step):
        return self._all("optim_step", step)

    def load_state(self, *args):
        return self._all("load_state", *args)

    def rank_actors(self) -> list:
        """The ranks' actor handles (a test kills one, as a lost node would)."""
        return list(self._ranks.actors)

    def notice(self) -> str | None:
        """The first rank's notice for its node, in words; None while no rank has one."""
        for worker in self._ranks.actors:
            try:
                heard = ray.get(worker.notice.remote(), timeout=10)
            except (RayActorError, GetTimeoutError):
                continue
            if heard is not None:
                return heard
        return None

    # Rank 0 alone: these write or read the bucket, and rank 0 holds what every rank holds.

    def models(self) -> list[str]:
        return self._rank0("models")

    def publish(self, *args):
        return self._rank0("publish", *args)

    def save_state(self, *args):
        return self._rank0("save_state", *args)

    def export(self, *args):
        return self._rank0("export", *args)

    def adopt(self, *args):
        return self._rank0("adopt", *args)
