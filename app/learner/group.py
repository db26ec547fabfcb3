"""The learner as the driver sees it: a group of Ray actors, one per device, that survives their deaths.

`LearnerGroup` starts `learner.num_workers` `LearnerRankActor` actors (each a `LearnerRank` from
`app.learner.rank`), has rank 0 pick a rendezvous port on its node, and joins them into one
torch.distributed group (`app.learner.rank_group.RankGroup`, the Tinker learner's too). With several GPU workers they are placed on one node (STRICT_PACK): NCCL
stays inside the learner node, and nothing but the bucket (the weights) and rank 0's Serve handle to the
fleet's ingress (which version to load, `app.weight_sync`) connects the learner to the fleet. A
step's groups reach the ranks as an ObjectRef of the rollout's `RolloutBatch`, which each rank
fetches from the object store itself: the driver never holds the data.

A dead worker (a preempted spot node, an OOM kill) is restarted by Ray (`max_restarts`). Its peers
are then stuck in a collective that will never complete, so the group kills and restarts them too,
and every rank resumes from the newest committed checkpoint in the bucket. The step that was
interrupted is retried once on the same batch, so the driver sees a slower step, not an error (a
worker that died between steps is noticed at the next one: restarted, it answers `NotStarted`);
`learner/restarts` in the metrics counts these recoveries, and `step` tells how far the learner
fell back (to its last checkpoint). An error raised by the training code itself is not retried (it
would fail again) but the group is still reset so that it can be used afterwards.

A spot notice warns first (`app.learner.notices`): rank 0 watches its node, every step from then on is
committed, and a step the deadline leaves no time for is abandoned; the group then waits for the node to go
and trains the same batch on the restarted ranks, which resume exactly where the abandoned step began.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from app.learner.model import rendezvous_address
from app.learner.notices import OUTLIVED_S
from app.learner.rank import LearnerRank, NotStarted
from app.learner.rank_group import RankGroup
from app.messages import ResumePoint, StepResult
from contracts.auth import Secret
from contracts.rollouts import RolloutBatch
from core.config import RunConfig

log = logging.getLogger(__name__)

MAX_RETRIES = 2  # of one step: a worker's death, or an abandoned step and the node's loss after it
_DEAD = RayActorError  # ActorDiedError, ActorUnavailableError and their kin


class StepNotTrained(RuntimeError):
    """A step could not be trained (abandoned on noticed nodes again and again): the run stops rather than drop its
    batch, whose groups a resume from the last checkpoint produces again."""


class _WorkersLost(Exception):
    """Workers died during the step, or before it (Ray restarted them): `dead` are their ranks."""

    def __init__(self, cause: Exception, dead: set[int]):
        super().__init__(str(cause))
        self.cause, self.dead = cause, dead

    @property
    def cause_name(self) -> str:
        return type(self.cause).__name__


class LearnerRankActor(LearnerRank):
    """One learner rank in its own Ray actor process."""

    def __init__(
        self,
        cfg: RunConfig,
        model_path: str,
        rank: int,
        world_size: int,
        fleet_url: str | None = None,
        fleet_token: str | None = None,
        signing_key: Secret | None = None,
    ):
        import torch

        # Ray reserves CPUs per actor but does not stop torch from starting a thread per core.
        torch.set_num_threads(max(1, int(cfg.learner.num_cpus_per_worker)))
        super().__init__(cfg, model_path, rank, world_size, fleet_url, fleet_token, signing_key)
        # The notice watcher's thread commits an idle learner at once: a step and a checkpoint hold this lock.
        self._busy = threading.RLock()
        self._incarnation = uuid.uuid4().hex
        self.notices.watch(rank, on_notice=self._commit_if_idle)

    def train_step(self, batch):
        with self._busy:
            return super().train_step(batch)

    def save_checkpoint(self) -> float:
        with self._busy:
            return super().save_checkpoint()

    def _commit_if_idle(self) -> None:
        """A notice came between steps: commit now (one rank alone; several ranks commit together, collectively,
        before their next step)."""
        if self.world_size == 1 and self.is_started() and self._busy.acquire(blocking=False):
            try:
                self.save_checkpoint()
            finally:
                self._busy.release()

    def incarnation(self) -> str:
        """This process's token: new in each process Ray restarts the rank in (`RankGroup.restart`)."""
        return self._incarnation

    def is_started(self) -> bool:
        """False for a worker Ray restarted (its node went) that the group has not resumed yet."""
        return self._started

    def rendezvous_address(self) -> tuple[str, int]:
        return rendezvous_address()

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the ranks at rank 0's rendezvous address (`RankGroup`): `setup` there."""
        self.setup(master_addr, master_port)


class LearnerGroup:
    """1..N learner ranks behind one interface: `start`, `train_step`, `shutdown`."""

    def __init__(
        self,
        cfg: RunConfig,
        model_path: str,
        fleet_url: str | None = None,
        fleet_token: str | None = None,
        signing_key: Secret | None = None,
    ):
        """`signing_key`: the key the fleet gave this run's lineage (`contracts.auth.lineage_key`), which rank 0
        signs every version with."""
        self.cfg = cfg
        self.restarts = 0
        self.abandoned = 0  # steps a spot notice left no time for, trained again on the node's replacement
        self.last_resume: ResumePoint | None = None  # what the ranks resumed from at the last recovery
        lcfg = cfg.learner
        n = lcfg.num_workers
        bundle = {
            "CPU": lcfg.num_cpus_per_worker,
            **({"GPU": lcfg.num_gpus_per_worker} if lcfg.device == "cuda" else {}),
        }
        # Custom resources (the cluster's `learner_node`) go on rank 0's bundle only: the node has one unit,
        # and STRICT_PACK puts every GPU rank beside rank 0 (NCCL never leaves the learner node).
        bundles = [{**bundle, **lcfg.ray_resources}] + [bundle] * (n - 1)
        # Only rank 0 publishes; `fleet_url` is best `deployments.fleet.cluster_address`: this node cannot
        # count on reaching the fleet's HTTP proxy, which listens on the head at an address as the head sees it.
        fleet = (fleet_url, fleet_token, signing_key)

        def args_of(rank: int) -> tuple:
            return (cfg, model_path, rank, n, *(fleet if rank == 0 else (None, None, None)))

        # Ray restarts a dead worker (on the node that replaces a lost one); the group then resumes every rank.
        self._ranks = RankGroup(LearnerRankActor, args_of, bundles, max_restarts=lcfg.max_restarts, what="learner")

    @property
    def workers(self) -> list:
        """The ranks' actor handles, rank 0 first."""
        return self._ranks.actors

    def _reset(self, dead: set[int]) -> ResumePoint:
        """Restart every rank (the dead ones are already restarting) and resume them from the bucket."""
        self._ranks.restart(dead)
        self.restarts += 1
        self.last_resume = self.start()
        log.warning(
            "learner resumed at step %s, policy version %s", self.last_resume.step, self.last_resume.policy_version
        )
        return self.last_resume

    def _dead_ranks(self, refs_by_rank: list) -> set[int]:
        dead = set()
        for i, ref in enumerate(refs_by_rank):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except (_DEAD, NotStarted):  # dead, or already restarted by Ray: either way not to be killed
                    dead.add(i)
                except RayTaskError:
                    pass
        return dead

    def start(self) -> ResumePoint:
        """Resume from the newest committed checkpoint if any, else publish the untrained adapter as policy-v0."""
        return self._ranks.all("start")[0]

    def train_step(self, batch: RolloutBatch | ray.ObjectRef) -> StepResult:
        """One optimizer step on the batch's groups (those already trained on are skipped); rank 0's result.

        `batch` is best an ObjectRef (of `RolloutActor.get_groups`): every rank fetches it from the object
        store, and a retried step sends the same ref again. When a worker dies during the step, the group
        restarts every rank from the newest checkpoint and retries the step once; the metrics then carry
        `learner/restarts` and `learner/resumed_step`. A step abandoned on a noticed node is trained again on its
        replacement; one that cannot be trained within `MAX_RETRIES` raises `StepNotTrained`: a step trains its
        batch or fails, it never returns without it (the groups would be dropped)."""
        batch_ref = self._stored(batch)
        resumed, retries = None, 0
        while True:
            try:
                result = self._attempt(batch_ref)
            except _WorkersLost as lost:  # died during the step, or between steps (Ray restarted them)
                if retries == MAX_RETRIES:
                    raise lost.cause from None
                retries += 1
                log.warning("a learner worker died (%s); restarting the group from the bucket", lost.cause_name)
                resumed = self._reset(lost.dead)
                continue
            if result.abandoned:
                if retries == MAX_RETRIES:
                    raise StepNotTrained(
                        f"learner: step {result.step + 1} was abandoned on noticed nodes {retries + 1} times and its "
                        f"batch ({len(result.batch.staleness) if result.batch else 0} groups) is not trained; stopping "
                        "rather than dropping it (the same command resumes from the last checkpoint)"
                    )
                retries += 1
                self.abandoned += 1
                resumed = self._outlive(result.node_deadline) or resumed
                continue
            result.metrics.update(
                {"learner/restarts": float(self.restarts), "learner/abandoned": float(self.abandoned)}
            )
            if resumed is not None:
                result.metrics["learner/resumed_step"] = float(resumed.step)
            return result

    @staticmethod
    def _stored(batch: RolloutBatch | ray.ObjectRef) -> ray.ObjectRef:
        """One copy in the object store, however many ranks read it and however often the step is tried."""
        return batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)

    def _attempt(self, batch_ref: ray.ObjectRef) -> StepResult:
        """One try of the step on every rank: rank 0's result, `_WorkersLost` when a worker is dead."""
        refs = self._ranks.call("train_step", batch_ref)
        try:
            RankGroup.wait(refs)
        except (_DEAD, NotStarted) as exc:
            raise _WorkersLost(exc, self._dead_ranks(refs)) from None
        except RayTaskError:
            if len(self.workers) > 1:  # peers of the failed rank are stuck in a collective
                self._reset(self._dead_ranks(refs))
            raise
        return ray.get(refs[0])

    def _outlive(self, deadline: float | None) -> ResumePoint | None:
        """After an abandoned step: wait for the noticed node to go (a worker dead, or restarted by Ray and not yet
        resumed), then restart the group from the bucket; None when every worker outlived the deadline (the node
        stayed after all: they train on)."""
        until = (deadline or time.time()) + OUTLIVED_S + 5.0
        log.warning("learner: waiting for the noticed node to go, to train the abandoned step on its replacement")
        while time.time() < until:
            gone = set()
            for i, w in enumerate(self.workers):
                try:
                    if not ray.get(w.is_started.remote(), timeout=10):
                        gone.add(i)
                except (_DEAD, GetTimeoutError):
                    gone.add(i)
            if gone:
                return self._reset(gone)
            time.sleep(1.0)
        return None

    def checkpoint(self) -> float:
        """Commit the learner's whole state to the bucket now (a collective: every rank takes part); seconds taken."""
        return self._ranks.all("save_checkpoint")[0]

    def state(self) -> ResumePoint:
        """The learner's counters as rank 0 holds them."""
        return self._ranks.rank0("get_state")

    def adapter_state_dict(self) -> dict:
        """The whole adapter, gathered from every shard."""
        return self._ranks.all("adapter_state_dict")[0]

    def optimizer_state_dict(self) -> dict:
        """The whole AdamW state, keyed by parameter name."""
        return self._ranks.all("optimizer_state_dict")[0]

    def shutdown(self) -> None:
        try:
            ray.get(self._ranks.call("close"), timeout=60)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.info("learner close: %s", exc)
        self._ranks.stop()
