"""Ranks that run collectives together, supervised as one: placed, joined, called and restarted together.

Both learners stand on `RankGroup`: the run's (`app.learner.group.LearnerGroup`) and the Tinker API's over several
devices (`app.learner.tinker_group.TinkerLearnerGroup`). It starts one actor per rank in a placement group (GPU ranks
packed on one node, so that NCCL never leaves it), joins them in one process group at rank 0's rendezvous address,
calls a method on every rank or on rank 0, and starts every rank again when one is lost: a rank's peers are then stuck
in a collective that never completes, so no rank can go on alone.

What a rank's death costs is each learner's own, and so is what it does then: the run's learner resumes every rank
from its last checkpoint and retries the step (its ranks are restarted by Ray, `restart`), the Tinker learner answers
the call as a lost learner and starts new ranks with the base model alone (`replace`), the service restoring each
client from its last saved state. A rank answers `rendezvous_address()` and `join(address, port)`, and, where Ray
restarts it, `incarnation()`: a token of its own process, new in every process Ray starts it in again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

PLACEMENT_TIMEOUT_S = 900.0
RESTART_TIMEOUT_S = 600.0


def ready_placement_group(bundles: list[dict], gpus: bool, what: str):
    """A placement group of the ranks' bundles, once placed: GPU ranks share a node (STRICT_PACK), so that NCCL stays
    inside it. An autoscaler may have to bring that (spot) node up first, hence the long wait."""
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy="STRICT_PACK" if gpus else "PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        raise RuntimeError(
            f"{what}: no room for {len(bundles)} ranks {bundles} within {PLACEMENT_TIMEOUT_S:.0f} s "
            f"(cluster resources: {ray.cluster_resources()})"
        ) from None
    return group


class RankGroup:
    """One actor of `actor_class` per bundle: rank `r` is built from `args_of(r)` and given `bundles[r]`.

    Several ranks are placed in one placement group; a lone rank asks for its bundle's custom resources itself.
    `max_restarts` is Ray's, for each rank: `restart` waits for Ray to bring the ranks back, `replace` starts new ones
    (for ranks that Ray does not restart, `max_restarts=0`)."""

    def __init__(
        self,
        actor_class: type,
        args_of: Callable[[int], tuple],
        bundles: list[dict[str, float]],
        *,
        max_restarts: int,
        what: str,
    ):
        self._actor = ray.remote(actor_class)
        self._args_of, self._bundles = args_of, bundles
        self._max_restarts, self._what = max_restarts, what
        self._pg = None
        self.actors: list = []
        self._incarnations: list = []  # each rank's process at the last join (ranks Ray restarts)
        self._start()

    def _start(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if len(self._bundles) > 1:
            gpus = any("GPU" in bundle for bundle in self._bundles)
            self._pg = ready_placement_group(self._bundles, gpus, self._what)
        self.actors = []
        for rank, bundle in enumerate(self._bundles):
            options = {
                "num_cpus": bundle["CPU"],
                "num_gpus": bundle.get("GPU", 0),
                "max_restarts": self._max_restarts,
                "max_task_retries": 0,  # a call a rank died in is its learner's to retry, or not, never Ray's
            }
            if self._pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank
                )
            elif custom := {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}:
                options["resources"] = custom
            self.actors.append(self._actor.options(**options).remote(*self._args_of(rank)))
        self._join()

    def _join(self) -> None:
        if self._max_restarts:
            self._incarnations = self.all("incarnation")
        address, port = ray.get(self.actors[0].rendezvous_address.remote())
        self.all("join", address, port)

    def call(self, method: str, *args) -> list[ray.ObjectRef]:
        """`method` on every rank, in rank order (the same order on each, as their collectives need); their refs."""
        return [getattr(actor, method).remote(*args) for actor in self.actors]

    @staticmethod
    def wait(refs: list[ray.ObjectRef]) -> None:
        """Wait for every rank's result, raising the first failure without waiting for the other ranks
        (which may be blocked forever in a collective with the failed one)."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])

    def all(self, method: str, *args) -> list:
        """`method` on every rank: their results, or the first failure."""
        refs = self.call(method, *args)
        self.wait(refs)
        return ray.get(refs)

    def rank0(self, method: str, *args):
        """`method` on rank 0 alone (no collective: a read, a bucket write); its result."""
        return ray.get(getattr(self.actors[0], method).remote(*args))

    def restart(self, dead: set[int]) -> None:
        """Every rank restarted by Ray and joined again: the living ones are killed so that Ray restarts them too
        (`dead` are restarting already), on the placement group Ray keeps (it places a lost node's bundles again).

        `ray.kill` returns before the process is gone, so a rank's old process may still answer a call or two: a
        rank is back only once it answers from a new process (a new incarnation), else the join could reach the
        old one and the restart land on it after."""
        for rank, actor in enumerate(self.actors):
            if rank not in dead:
                ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        for rank, (actor, old) in enumerate(zip(self.actors, self._incarnations, strict=True)):
            while True:
                try:
                    if ray.get(actor.incarnation.remote(), timeout=30) != old:
                        break
                except (RayActorError, GetTimeoutError):  # dead, restarting, or still building itself
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self._what}: rank {rank} not back within {RESTART_TIMEOUT_S:.0f} s")
                time.sleep(1.0)
        self._join()

    def replace(self) -> None:
        """New ranks in a new placement group, joined, in place of every rank (which Ray does not restart)."""
        self.stop()
        self._start()

    def stop(self) -> None:
        """Kill every rank for good and free their placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
