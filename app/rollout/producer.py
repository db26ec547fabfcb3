"""The rollout's producer: plain asyncio that keeps the fleet busy and feeds the learner annotated groups.

It keeps up to `max_inflight_tasks` groups in flight, has its sampler (`app.rollout.sampling`: G single
completions in one request, scored off the event loop, or G multi-turn episodes) sample and score the
G samples of a prompt, tags the group with the policy version it was sampled under, has the run's teacher
score it when the run distils (`app.rollout.teacher`: asynchronous, so before annotating), has the run's
objectives annotate it (`app.objectives`: GRPO's advantages, for one) and puts it on a bounded queue.
A slot is held until its group is on the queue, so a slow learner stops new requests instead of
growing memory (backpressure). Groups more than `max_staleness` versions behind the learner are
dropped and counted when taken, never trained (a multi-turn group as soon as it is found stale,
between turns). A request that still fails after the fleet client's retries costs its group,
counted, never the producer; so does a teacher that fails or times out (counted apart).

No Ray here, so that tests drive it with a fake `generate` behind its sampler; `app.rollout.actor` hosts
it in Ray.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from app.messages import ResumePoint, RolloutStats
from app.objectives import Objectives
from app.objectives.distill import TEACHER_LOGPROBS
from app.rollout.sampling import GroupStale, Sampler, SamplingArgs
from app.rollout.teacher import TeacherScorer
from app.tasks.problems import Problem
from contracts.adapters import adapter_name
from contracts.rollouts import Group, RolloutBatch

log = logging.getLogger(__name__)


class GroupProducer:
    """Produces scored, version-tagged groups into a bounded queue; the learner takes them as `RolloutBatch`es."""

    def __init__(
        self,
        cfg,
        problems: list[Problem],
        prompt_ids: Callable[[Problem], list[int]],
        sampler: Sampler,
        *,
        resume: ResumePoint | None = None,  # where to go on; None: a fresh run
        retries_done: Callable[[], int] = lambda: 0,  # the fleet client's retries so far, for the metrics
        teacher: TeacherScorer | None = None,  # scores every group before it is annotated (a distilling run)
    ):
        self.cfg = cfg
        self.problems, self.prompt_ids, self.sampler, self.teacher = problems, prompt_ids, sampler, teacher
        self.objectives = Objectives.from_config(cfg)
        if any(TEACHER_LOGPROBS in o.streams for o in self.objectives.objectives) and teacher is None:
            raise ValueError("objectives: a distill objective needs a teacher to score the groups; none was given")
        g = cfg.grpo
        self.sampling = SamplingArgs(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        self.retries_done = retries_done
        resume = resume or ResumePoint()
        self.cursor = resume.data_cursor or 0
        self.sampling_version = resume.policy_version  # version new requests use (the newest the fleet serves)
        self.learner_version = resume.policy_version  # version the learner trains now; staleness is measured to it
        self.consumed = set(resume.consumed_group_ids)
        self.queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=cfg.rollout.queue_maxsize)
        self._slots = asyncio.Semaphore(cfg.rollout.max_inflight_tasks)
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self._pending: set[int] = set()  # indices issued but not yet taken or lost: the resume frontier
        self.queue_size_at_take = 0
        self.counters = {
            "groups_produced": 0,
            "dropped_stale": 0,
            "dropped_failed": 0,
            "groups_taken": 0,
            "teacher_failed": 0,
        }

    # -- data order ------------------------------------------------------------------------
    def _problem_at(self, index: int) -> Problem:
        """Epoch-shuffled order, a pure function of the index, so a resumed cursor replays exactly."""
        epoch, pos = divmod(index, len(self.problems))
        order = list(range(len(self.problems)))
        random.Random(self.cfg.grpo.seed + epoch).shuffle(order)
        return self.problems[order[pos]]

    # -- producing -------------------------------------------------------------------------
    def start(self) -> None:
        """Start producing ahead of the learner (async mode); in sync mode `get_groups` generates on demand."""
        if self._producer is None and self.cfg.rollout.mode == "async":
            self._producer = asyncio.get_running_loop().create_task(self._produce_forever())

    async def _produce_forever(self) -> None:
        while True:
            await self._spawn_next()

    async def _spawn_next(self) -> None:
        await self._slots.acquire()
        index = self.cursor
        self.cursor += 1
        if index in self.consumed:  # trained before a restart: never feed it twice
            self._slots.release()
            return
        self._pending.add(index)
        task = asyncio.create_task(self._produce_group(index, self._problem_at(index)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce_group(self, index: int, problem: Problem) -> None:
        try:
            group = await self._sample_and_score(index, problem)
            if group is None:
                self._pending.discard(index)
            else:
                await self.queue.put(group)  # blocks while the queue is full: backpressure
                self.counters["groups_produced"] += 1
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in scoring must not kill the producer; count the group as lost
            log.exception("group %d failed", index)
            self.counters["dropped_failed"] += 1
            self._pending.discard(index)
        finally:
            self._slots.release()

    async def _sample_and_score(self, group_id: int, problem: Problem) -> Group | None:
        version = self.sampling_version
        prompt_ids = self.prompt_ids(problem)
        try:
            # The fleet client retries what is worth retrying (`app.retry`): what still fails here is final.
            sampled = await self.sampler.sample(
                problem,
                prompt_ids,
                adapter_name(version, self.cfg.fleet_run),
                self.cfg.grpo.num_generations,
                self.sampling,
                is_fresh=lambda: not self._too_stale(version),
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if isinstance(e, GroupStale) or self._too_stale(version):  # its version's time was up: no failure
                log.debug("group %d went stale while it was sampled: %s", group_id, e)
                self.counters["dropped_stale"] += 1
            else:
                log.warning("generation for group %d failed, dropping it: %s", group_id, e)
                self.counters["dropped_failed"] += 1
            return None
        group = Group(group_id, problem.id, prompt_ids, version, sampled.samples, time.time(), sampled.reward_errors)
        if self.teacher is not None:
            try:
                await self.teacher.score(group)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the teacher's failure costs this group alone
                log.warning("the teacher failed to score group %d, dropping it: %s", group_id, e)
                self.counters["teacher_failed"] += 1
                return None
        return self.objectives.annotate(group)

    # -- consuming -------------------------------------------------------------------------
    def set_policy_version(self, policy_version: int) -> None:
        """The learner published (and the fleet loaded) `policy_version`: sample with it, measure staleness to it."""
        self.sampling_version = max(self.sampling_version, policy_version)
        self.learner_version = max(self.learner_version, policy_version)

    async def get_groups(self, n: int, timeout_s: float | None = None) -> RolloutBatch:
        """Take `n` fresh groups (waiting for them), dropping and counting those too stale to train.

        The batch carries the data frontier after the take (where a resumed run goes on) and the learner
        version that staleness was measured to."""
        groups: list[Group] = []
        # What the learner found when it asked: right after a take, blocked producers refill the queue at once.
        self.queue_size_at_take = self.queue.qsize()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        synchronous = self.cfg.rollout.mode == "sync"
        while len(groups) < n:
            self._raise_if_producer_died()
            if synchronous:  # generate exactly what is missing, with the current version, only now
                for _ in range(n - len(groups) - len(self._tasks) - self.queue.qsize()):
                    await self._spawn_next()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Wake up now and then: a failed group must be generated again (sync), a dead producer noticed.
            remaining = 1.0 if remaining is None else min(remaining, 1.0)
            try:
                group = await asyncio.wait_for(self.queue.get(), timeout=remaining)
            except TimeoutError:
                if deadline is None or time.monotonic() < deadline:
                    continue
                break
            self._pending.discard(group.group_id)
            if self._too_stale(group.policy_version):
                self.counters["dropped_stale"] += 1
                continue
            groups.append(group)
        self.counters["groups_taken"] += len(groups)
        self.consumed.update(g.group_id for g in groups)
        return RolloutBatch(groups, data_cursor=self.frontier, learner_version=self.learner_version)

    def _too_stale(self, policy_version: int) -> bool:
        """Sampled more than `max_staleness` versions behind the learner: never to be trained."""
        return self.learner_version - policy_version > self.cfg.grpo.max_staleness

    def _raise_if_producer_died(self) -> None:
        """The producer only ends by a bug; waiting for groups it will never make would hang the run."""
        if self._producer is not None and self._producer.done() and not self._producer.cancelled():
            raise RuntimeError("the rollout producer died") from self._producer.exception()

    @property
    def frontier(self) -> int:
        """Lowest data index not yet settled: a resumed run restarts here (consumed ids skip the trained ones)."""
        return min(self._pending, default=self.cursor)

    def stats(self) -> RolloutStats:
        c = self.counters
        seen = c["groups_taken"] + c["dropped_stale"]
        return RolloutStats(
            queue_size_at_take=self.queue_size_at_take,
            queue_size_now=self.queue.qsize(),
            inflight=self.sampler.meter.inflight,
            generated_tok_s=self.sampler.meter.generated_tok_s(),
            dropped_stale_total=c["dropped_stale"],
            dropped_stale_share=c["dropped_stale"] / seen if seen else 0.0,
            dropped_failed_total=c["dropped_failed"],
            request_retries_total=self.retries_done(),
            groups_produced_total=c["groups_produced"],
            data_cursor=self.cursor,
            data_frontier=self.frontier,
            idle_s=self.sampler.meter.idle_s(),
            reward_metrics=self.sampler.reward_metrics(),
            env_errors_total=self.sampler.env_errors,
            teacher_failed_total=c["teacher_failed"] if self.teacher is not None else None,
        )

    async def stop(self) -> None:
        tasks = [t for t in (self._producer, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None
        self.sampler.close()
        if self.teacher is not None:
            await self.teacher.aclose()
