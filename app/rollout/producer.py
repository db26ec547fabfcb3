"""The rollout's producer: plain asyncio that keeps the fleet busy and feeds the learner annotated groups.

It keeps up to `max_inflight_tasks` groups in flight, has its sampler (`app.rollout.sampling`: G single
completions in one request, scored off the event loop, or G multi-turn episodes) sample and score the
G samples of a prompt, tags the group with the policy version it started under (and every token with
the version that sampled it), has the run's teacher score it when the run distils (`app.rollout.teacher`:
asynchronous, so before annotating), has the run's objectives annotate it (`app.objectives`: GRPO's
advantages, for one) and puts it on a bounded queue. A slot is held until its group is on the queue,
so a slow learner stops new requests instead of growing memory (backpressure). How stale a group may
get is the staleness rule's (`app.rollout.staleness`): drop at take time, or bound at admission with a
hard limit; a group that could never be trained is dropped and counted when taken (a multi-turn group
as soon as it is found so, between turns). A request that still fails after the fleet client's
retries costs its group, counted, never the producer; so does a teacher that fails or times out, or a judge
whose `on_failure` is drop that fails to score the group (each counted apart). Only when `rollout.max_failed_groups`
groups in a row failed (an environment that fails on every problem, a fleet or a judge gone for good) does taking
groups raise `GroupsKeepFailing`, naming the last cause, instead of waiting for ever for groups that will never come.

With partial rollouts on, a newer version cuts the run's generations in flight under versions at least
`partial_min_lag` behind (one `cut` call naming their adapters), and each group's sampler continues
them, and samples its later turns, under the newest version (`app.rollout.continuation`).

No Ray here, so that tests drive it with a fake `generate` behind its sampler; `app.rollout.actor` hosts
it in Ray.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from app.messages import ResumePoint, RolloutStats
from app.objectives import Objectives
from app.objectives.distill import TEACHER_LOGPROBS
from app.rollout.continuation import Flight, version_of
from app.rollout.judges import rewarding_judges
from app.rollout.overlong import OverlongShaping
from app.rollout.sampling import GroupStale, Sampled, Sampler, SamplingArgs
from app.rollout.staleness import StalenessRule, figures
from app.rollout.teacher import TeacherChoice, TeacherScorer
from app.tasks.problems import Problem
from contracts.adapters import adapter_name
from contracts.rollouts import Group, RolloutBatch

log = logging.getLogger(__name__)


class GroupsKeepFailing(RuntimeError):
    """Every one of the last `rollout.max_failed_groups` groups failed: no group is coming, the run cannot go on."""


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
        cut: Callable[[list[str]], Awaitable[Any]] | None = None,  # cut the generations under these adapters
        # Scores every group before it is annotated (a distilling run): its teacher, or a choice among several.
        teacher: TeacherScorer | TeacherChoice | None = None,
    ):
        self.cfg = cfg
        self.problems, self.prompt_ids, self.sampler, self.teacher = problems, prompt_ids, sampler, teacher
        self.objectives = Objectives.from_config(cfg)
        if any(TEACHER_LOGPROBS in o.streams for o in self.objectives.objectives) and teacher is None:
            raise ValueError("objectives: a distill objective needs a teacher to score the groups; none was given")
        s = cfg.sampling
        self.sampling = SamplingArgs(s.max_completion_length, s.temperature, s.top_p, s.top_k, s.min_p)
        self.retries_done, self.cut = retries_done, cut
        self.staleness = StalenessRule.from_config(cfg)
        self.overlong = OverlongShaping.from_config(cfg)
        # Judges whose failure costs the group (`judges.<name>.on_failure: drop`), by the name the scorer counts under.
        self.dropping_judges = [n for n, j in rewarding_judges(cfg).items() if j.on_failure == "drop"]
        resume = resume or ResumePoint()
        self.cursor = resume.data_cursor or 0
        self.sampling_version = resume.policy_version  # version new requests use (the newest the fleet serves)
        self.learner_version = resume.policy_version  # version the learner trains now; staleness is measured to it
        self.consumed = resume.consumed()  # trained before a restart: never produced again
        self.queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=cfg.rollout.queue_maxsize)
        self._slots = asyncio.Semaphore(cfg.rollout.max_inflight_tasks)
        bound = self.staleness.admission_bound
        # Admitted and not yet taken, lost or dropped: a group starts only within the bound (none in sync mode).
        self._admission = asyncio.Semaphore(bound) if bound and cfg.rollout.mode == "async" else None
        self._flights: dict[int, Flight] = {}  # the groups being sampled, by index
        self._cuts: set[asyncio.Task] = set()
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self._pending: set[int] = set()  # indices issued but not yet taken or lost: the resume frontier
        self.queue_size_at_take = 0
        self.counters = {
            "groups_produced": 0,
            "dropped_stale": 0,
            "dropped_failed": 0,
            "groups_taken": 0,
            "cut_calls": 0,
            "cut_failures": 0,
            "teacher_failed": 0,
            "dropped_judge_failed": 0,  # groups a judge that drops (on_failure: drop) failed to score
            "scored": 0,  # groups sampled and scored (dynamic sampling's denominator)
            "zero_variance": 0,  # of them, those whose rewards were all equal
            "dropped_zero_variance": 0,  # of those, dropped by dynamic sampling (each one more group sampled)
            "overlong_penalised": 0,  # samples whose reward the overlong penalty lowered
            "truncated_masked": 0,  # truncated samples given no reward (rollout.mask_truncated)
        }
        self.zero_variance_in_row = 0  # dropped by dynamic sampling since the last informative group
        self.failed_in_row = 0  # groups lost (failed, or their teacher did) since the last one produced
        self.last_failure = ""  # why the last of them was lost, in one line

    # -- data order ------------------------------------------------------------------------
    def _problem_at(self, index: int) -> Problem:
        """Epoch-shuffled order, a pure function of the index, so a resumed cursor replays exactly."""
        epoch, pos = divmod(index, len(self.problems))
        order = list(range(len(self.problems)))
        random.Random(self.cfg.train.seed + epoch).shuffle(order)
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
        if self._admission is not None:
            await self._admission.acquire()
        index = self.cursor
        self.cursor += 1
        skip = index in self.consumed  # trained before a restart: never feed it twice
        self.consumed.advance(self.cursor)  # nothing below the cursor is asked about again
        if skip:
            self._slots.release()
            self._leave_admission()
            return
        self._pending.add(index)
        task = asyncio.create_task(self._produce_group(index, self._problem_at(index)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce_group(self, index: int, problem: Problem) -> None:
        try:
            group = await self._sample_and_score(index, problem)
            if group is None:
                self._settle(index)
            else:
                await self.queue.put(group)  # blocks while the queue is full: backpressure
                self.counters["groups_produced"] += 1
                self.failed_in_row = 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in scoring must not kill the producer; count the group as lost
            log.exception("group %d failed", index)
            self.counters["dropped_failed"] += 1
            self._failed(e)
            self._settle(index)
        finally:
            self._slots.release()

    def _settle(self, index: int) -> None:
        """Group `index` left the pipeline (taken, dropped or lost): off the resume frontier, out of admission."""
        if index in self._pending:
            self._pending.discard(index)
            self._leave_admission()

    def _leave_admission(self) -> None:
        if self._admission is not None:
            self._admission.release()

    async def _sample_and_score(self, group_id: int, problem: Problem) -> Group | None:
        version = self.sampling_version
        prompt_ids = self.prompt_ids(problem)
        model = adapter_name(version, self.cfg.fleet_run)
        partial = self.cfg.rollout.partial_rollouts
        flight = Flight(
            version,
            self._newest_model if partial else lambda: model,
            may_go_on=lambda: not self._too_stale(version),  # its oldest token is its first, sampled under `version`
        )
        self._flights[group_id] = flight
        try:
            # The fleet client retries what is worth retrying (`app.retry`): what still fails here is final.
            sampled = await self.sampler.sample(
                problem, prompt_ids, model, self.cfg.sampling.num_generations, self.sampling, flight
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
                self._failed(e)
            return None
        finally:
            del self._flights[group_id]
        if self._judge_failed(group_id, sampled):  # before anything else spends on it
            return None
        if sampled.prompt_ids is not None:  # the sampler rendered the prompt itself (a TRL environment's)
            prompt_ids = sampled.prompt_ids
        group = Group(group_id, problem.id, prompt_ids, version, sampled.samples, time.time(), sampled.reward_errors)
        if self.overlong.active:  # shaped before dynamic sampling judges the group's variance
            penalised, masked = self.overlong.apply(group)
            self.counters["overlong_penalised"] += penalised
            self.counters["truncated_masked"] += masked
        if self._drop_uninformative(group):  # before the teacher: a dropped group costs it nothing
            return None
        if self.teacher is not None:
            try:
                await self.teacher.score(group, problem, self._newest_model())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the teacher's failure costs this group alone
                log.warning("the teacher failed to score group %d, dropping it: %s", group_id, e)
                self.counters["teacher_failed"] += 1
                self._failed(e, "the teacher: ")
                return None
        return self.objectives.annotate(group)

    def _drop_uninformative(self, group: Group) -> bool:
        """Dynamic sampling (DAPO): a group whose rewards are all equal has no advantage, so no gradient; drop it and
        let the producer sample another in its place. Its problem is consumed (the cursor went past it), never retried.
        After `dynamic_sampling_max_extra` drops in a row the next one is trained anyway, as plain GRPO would: a task
        the model always solves (or never does) then slows the run down by a bounded amount instead of stalling it."""
        self.counters["scored"] += 1
        if not zero_variance(group):
            self.zero_variance_in_row = 0
            return False
        self.counters["zero_variance"] += 1
        r = self.cfg.rollout
        if not r.dynamic_sampling or self.zero_variance_in_row >= r.dynamic_sampling_max_extra:
            self.zero_variance_in_row = 0
            return False
        self.zero_variance_in_row += 1
        self.counters["dropped_zero_variance"] += 1
        return True

    def _judge_failed(self, group_id: int, sampled: Sampled) -> bool:
        """A judge whose `on_failure` is drop failed to score the group (raised or timed out: the scorer counted its
        samples as that judge's errors): drop it, counted, and let the producer sample another in its place. Such
        drops count as lost groups too, so a judge that fails on every group ends the run (`rollout.max_failed_groups`)
        instead of the producer sampling for ever."""
        failed = [name for name in self.dropping_judges if sampled.reward_errors.get(name)]
        if not failed:
            return False
        log.warning("judge %s failed to score group %d, dropping it (on_failure: drop)", failed[0], group_id)
        self.counters["dropped_judge_failed"] += 1
        self._failed(f"judge {failed[0]} failing to score it (on_failure: drop)")
        return True

    def _failed(self, error: BaseException | str, where: str = "") -> None:
        self.failed_in_row += 1
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.last_failure = f"{where}{why}".splitlines()[0]

    @property
    def failing(self) -> str | None:
        """One line naming the cause when the last `rollout.max_failed_groups` groups all failed, else None."""
        n = self.cfg.rollout.max_failed_groups
        if self.failed_in_row < n:
            return None
        return f"the last {n} groups all failed (rollout.max_failed_groups), the last one with {self.last_failure}"

    def _newest_model(self) -> str:
        return adapter_name(self.sampling_version, self.cfg.fleet_run)

    # -- consuming -------------------------------------------------------------------------
    def set_policy_version(self, policy_version: int) -> None:
        """The learner published (and the fleet loaded) `policy_version`: sample with it, measure staleness to it,
        and, with partial rollouts on, cut what is in flight under versions `partial_min_lag` behind it."""
        self.sampling_version = max(self.sampling_version, policy_version)
        self.learner_version = max(self.learner_version, policy_version)
        if self.cfg.rollout.partial_rollouts and self.cut is not None:
            self._cut_behind(self.sampling_version)

    def _cut_behind(self, newest: int) -> None:
        """One cut call naming every adapter at least `partial_min_lag` versions behind `newest` that a request of
        this run is on the wire under; sent in the background, so that whoever told us the version never waits."""
        lag = self.cfg.rollout.partial_min_lag
        models = sorted(
            {
                model
                for flight in self._flights.values()
                for model in flight.on_wire
                if (v := version_of(model)) is not None and newest - v >= lag
            }
        )
        if models:
            task = asyncio.get_running_loop().create_task(self._send_cut(models))
            self._cuts.add(task)
            task.add_done_callback(self._cuts.discard)

    async def _send_cut(self, models: list[str]) -> None:
        self.counters["cut_calls"] += 1
        try:
            await self.cut(models)
        except Exception as e:  # a cut that failed costs only time: those generations finish on their version
            self.counters["cut_failures"] += 1
            log.warning("cutting %s failed: %s", ", ".join(models), e)

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
            if self.failing is not None:
                raise GroupsKeepFailing(self.failing)
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
            self._settle(group.group_id)
            if self._too_stale(group.oldest_version):
                self.counters["dropped_stale"] += 1
                continue
            groups.append(group)
        self.counters["groups_taken"] += len(groups)
        return RolloutBatch(groups, data_cursor=self.frontier, learner_version=self.learner_version)

    def _too_stale(self, oldest_version: int) -> bool:
        """A group whose oldest token was sampled under `oldest_version` can never be trained (the staleness rule)."""
        return self.staleness.too_stale(self.learner_version, oldest_version)

    def _raise_if_producer_died(self) -> None:
        """The producer only ends by a bug; waiting for groups it will never make would hang the run."""
        if self._producer is not None and self._producer.done() and not self._producer.cancelled():
            raise RuntimeError("the rollout producer died") from self._producer.exception()

    @property
    def frontier(self) -> int:
        """Lowest data index not yet settled: a resumed run restarts here (consumed ids skip the trained ones)."""
        return min(self._pending, default=self.cursor)

    def stats(self) -> RolloutStats:
        c, cuts = self.counters, self.sampler.continuation.counters
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
            staleness_inflight=figures(self.learner_version, map(_flight_span, list(self._flights.values()))),
            staleness_queue=figures(
                self.learner_version, (_sample_span(g, s) for g in self._queued() for s in g.samples)
            ),
            cut_share=cuts.cut_choices / cuts.choices if cuts.choices else 0.0,
            cuts_total=cuts.cuts,
            prefilled_again_total=cuts.prefilled_again,
            teacher_failed_total=c["teacher_failed"] if self.teacher is not None else None,
            teacher_failed_by=getattr(self.teacher, "failed_by_teacher", dict)(),
            failing=self.failing,
            zero_variance_share=c["zero_variance"] / c["scored"] if c["scored"] else 0.0,
            dropped_zero_variance_total=c["dropped_zero_variance"],
            dropped_judge_failed_total=c["dropped_judge_failed"],
            overlong_penalised_total=c["overlong_penalised"],
            truncated_masked_total=c["truncated_masked"],
        )

    def _queued(self) -> list[Group]:
        return list(self.queue._queue)  # a look, not a take: asyncio.Queue keeps its items in a deque

    async def stop(self) -> None:
        tasks = [t for t in (self._producer, *self._tasks, *self._cuts) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None
        self.sampler.close()
        if self.teacher is not None:
            await self.teacher.aclose()


def _flight_span(flight: Flight) -> tuple[int, int, float | None]:
    """(oldest, newest, token mean) versions of a group in flight: its first request's, its latest's, what came back."""
    got = sum(flight.got.values())
    mean = sum(v * k for v, k in flight.got.items()) / got if got else None
    return flight.started, flight.newest if flight.newest is not None else flight.started, mean


def _sample_span(group: Group, sample) -> tuple[int, int, float]:
    versions = sample.token_versions() or [group.policy_version]
    return min(versions), max(versions), sum(versions) / len(versions)


def zero_variance(group: Group) -> bool:
    """All scored rewards equal (NaN, unscorable, left out): every advantage of the group is zero."""
    rewards = {s.reward for s in group.samples if not math.isnan(s.reward)}
    return len(rewards) <= 1
