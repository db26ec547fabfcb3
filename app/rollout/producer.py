"""The rollout side: an async producer that keeps the fleet busy and feeds the learner scored groups.

It keeps up to `max_inflight_tasks` groups in flight, asks for the G samples of a prompt in one
request (so the router keeps them on one replica and vLLM prefills the prompt once), tags each
group with the policy version it was sampled under, scores it off the event loop and puts it on a
bounded queue. A slot is held until its group is on the queue, so a slow learner stops new
requests instead of growing memory (backpressure). Groups more than `max_staleness` versions
behind the learner are dropped and counted when taken, never trained. A request that keeps failing
costs its group, counted, never the worker.

`RolloutWorker` is plain asyncio (testable with a fake `generate`); `RolloutActor` hosts it in Ray.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import warnings
from collections import deque
from collections.abc import Awaitable, Callable

import ray

from app.auth import inference_token
from app.config import HEAD_NODE
from app.fleet_client import Choice, FleetClient
from app.messages import Group, Sample, adapter_name
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer

log = logging.getLogger(__name__)


# generate(prompt_ids, model, n, max_tokens, temperature, top_p, top_k) -> n choices: FleetClient.acompletions
Generate = Callable[..., Awaitable[list[Choice]]]


class RolloutWorker:
    """Produces scored, version-tagged groups into a bounded queue."""

    def __init__(
        self,
        cfg,
        problems: list[Problem],
        prompt_ids: Callable[[Problem], list[int]],
        generate: Generate,
        scorer: RewardScorer,
        *,
        data_cursor: int = 0,
        policy_version: int = 0,
        consumed_group_ids: set[str] | frozenset = frozenset(),
    ):
        self.cfg = cfg
        self.problems, self.prompt_ids, self.generate, self.scorer = problems, prompt_ids, generate, scorer
        self.cursor = data_cursor
        self.sampling_version = policy_version  # version new requests use (the newest the fleet serves)
        self.learner_version = policy_version  # version the learner trains now; staleness is measured to it
        self.consumed = set(consumed_group_ids)
        self.queue: asyncio.Queue[Group] = asyncio.Queue(maxsize=cfg.rollout.queue_maxsize)
        self._slots = asyncio.Semaphore(cfg.rollout.max_inflight_tasks)
        self._tasks: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None
        self.inflight = 0  # requests on the wire (a slot waiting to enqueue is not one)
        self._pending: set[int] = set()  # indices issued but not yet taken or lost: the resume frontier
        self._idle_s, self._idle_since = 0.0, time.monotonic()  # time with no request on the wire
        self.queue_size_at_take = 0
        self.counters = {
            "groups_produced": 0,
            "dropped_stale": 0,
            "dropped_failed": 0,
            "request_retries": 0,
            "groups_taken": 0,
            "completion_tokens": 0,
        }
        self._token_times: deque[tuple[float, int]] = deque(maxlen=512)

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
        if f"g{index}" in self.consumed:  # trained before a restart: never feed it twice
            self._slots.release()
            return
        self._pending.add(index)
        task = asyncio.create_task(self._produce_group(index, self._problem_at(index)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce_group(self, index: int, problem: Problem) -> None:
        try:
            group = await self._sample_and_score(f"g{index}", problem)
            if group is None:
                self._pending.discard(index)
            else:
                await self.queue.put(group)  # blocks while the queue is full: backpressure
                self.counters["groups_produced"] += 1
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in scoring must not kill the producer; count the group as lost
            log.exception("group g%d failed", index)
            self.counters["dropped_failed"] += 1
            self._pending.discard(index)
        finally:
            self._slots.release()

    async def _sample_and_score(self, group_id: str, problem: Problem) -> Group | None:
        g, cfg = self.cfg.grpo, self.cfg.rollout
        version = self.sampling_version
        prompt_ids = self.prompt_ids(problem)
        for attempt in range(cfg.max_retries + 1):
            self._count_inflight(+1)
            try:
                completions = await asyncio.wait_for(
                    self.generate(
                        prompt_ids,
                        adapter_name(version),
                        g.num_generations,
                        g.max_completion_length,
                        g.temperature,
                        g.top_p,
                        g.top_k,
                    ),
                    timeout=cfg.request_timeout_s,
                )
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters["request_retries"] += 1
                log.warning(
                    "generation for %s failed (attempt %d/%d): %s", group_id, attempt + 1, cfg.max_retries + 1, e
                )
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            finally:
                self._count_inflight(-1)
        else:
            self.counters["dropped_failed"] += 1
            return None
        ntok = sum(len(c.token_ids) for c in completions)
        self.counters["completion_tokens"] += ntok
        self._token_times.append((time.monotonic(), ntok))
        texts = [c.text for c in completions]
        truncated = [c.finish_reason == "length" for c in completions]
        columns = {
            "answer": [problem.answer] * len(texts),
            "truncated": truncated,
            **{k: [v] * len(texts) for k, v in problem.columns.items()},
        }
        scores = await asyncio.to_thread(
            self.scorer.score, texts, [problem.prompt] * len(texts), [c.token_ids for c in completions], **columns
        )
        samples = [
            Sample(c.token_ids, c.logprobs, r, t, c.text)
            for c, r, t in zip(completions, scores.rewards, truncated, strict=True)
        ]
        return Group(group_id, problem.id, prompt_ids, version, samples, time.time(), dict(scores.errors))

    def _count_inflight(self, delta: int) -> None:
        now = time.monotonic()
        if self.inflight == 0 and delta > 0:
            self._idle_s += now - self._idle_since
        self.inflight += delta
        if self.inflight == 0:
            self._idle_since = now

    def idle_s(self) -> float:
        """Seconds so far with no generation request on the wire (the fleet idle, as far as we know)."""
        return self._idle_s + (time.monotonic() - self._idle_since if self.inflight == 0 else 0.0)

    # -- consuming -------------------------------------------------------------------------
    def set_versions(self, policy_version: int) -> None:
        """The learner published (and the fleet loaded) `policy_version`: sample with it, measure staleness to it."""
        self.sampling_version = max(self.sampling_version, policy_version)
        self.learner_version = max(self.learner_version, policy_version)

    async def get_groups(self, n: int, timeout_s: float | None = None) -> list[Group]:
        """Take `n` fresh groups (waiting for them), dropping and counting those too stale to train."""
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
            self._pending.discard(int(group.group_id[1:]))
            if self.learner_version - group.policy_version > self.cfg.grpo.max_staleness:
                self.counters["dropped_stale"] += 1
                continue
            groups.append(group)
        self.counters["groups_taken"] += len(groups)
        self.consumed.update(g.group_id for g in groups)
        return groups

    def _raise_if_producer_died(self) -> None:
        """The producer only ends by a bug; waiting for groups it will never make would hang the run."""
        if self._producer is not None and self._producer.done() and not self._producer.cancelled():
            raise RuntimeError("the rollout producer died") from self._producer.exception()

    @property
    def frontier(self) -> int:
        """Lowest data index not yet settled: a resumed run restarts here (consumed ids skip the trained ones)."""
        return min(self._pending, default=self.cursor)

    def generated_tok_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._token_times if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(1e-6, recent[-1][0] - recent[0][0])

    def stats(self) -> dict[str, float]:
        c = self.counters
        seen = c["groups_taken"] + c["dropped_stale"]
        return {
            "sample/rollout_queue_size": self.queue_size_at_take,
            "rollout/queue_size_now": self.queue.qsize(),
            "rollout/inflight": self.inflight,
            "rollout/generated_tok_s": self.generated_tok_s(),
            "sample/dropped_stale_total": c["dropped_stale"],
            "sample/dropped_stale_share": c["dropped_stale"] / seen if seen else 0.0,
            "rollout/dropped_failed_total": c["dropped_failed"],
            "rollout/request_retries_total": c["request_retries"],
            "rollout/groups_produced_total": c["groups_produced"],
            "rollout/data_cursor": self.cursor,
            "rollout/data_frontier": self.frontier,
            "rollout/idle_s": self.idle_s(),
            **self.scorer.metrics(),
        }

    async def stop(self) -> None:
        tasks = [t for t in (self._producer, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None


# On the head node, which cluster.yaml keeps on-demand. Should it restart all the same, Ray retries the
# driver's calls on the new instance, which resumes from the bucket (`resume_state`).
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, resources=HEAD_NODE)
class RolloutActor:
    """Hosts a RolloutWorker in Ray, talking to the fleet over HTTP."""

    def __init__(self, cfg, model_path: str, fleet_url: str, state: dict):
        from app.models import load_tokenizer, prompt_token_ids
        from app.tasks.problems import load_task

        logging.basicConfig(level=logging.WARNING)
        with warnings.catch_warnings():  # Ray 2.60's own property trips its deprecated `actor_id`
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            # `state` is what the learner held when the run started: long outdated now.
            state = resume_state(cfg)
            log.warning("rollout actor restarted: resuming at %s", state)
        tokenizer = load_tokenizer(model_path)
        self.worker = RolloutWorker(
            cfg,
            load_task(cfg.task).train,
            lambda p: prompt_token_ids(tokenizer, p.prompt),
            # The worker retries a failed request itself (and counts it), so the client does not.
            FleetClient(
                fleet_url, inference_token(cfg), retries=0, timeout_s=cfg.rollout.request_timeout_s
            ).acompletions,
            RewardScorer.from_names(cfg.task.reward_funcs, cfg.task.reward_timeout_s),
            data_cursor=state.get("data_cursor") or 0,
            policy_version=state.get("policy_version") or 0,
            consumed_group_ids=set(state.get("consumed_group_ids", ())),
        )

    async def start(self) -> None:
        self.worker.start()

    async def set_versions(self, policy_version: int) -> None:
        self.worker.set_versions(policy_version)

    async def get_groups(self, n: int, timeout_s: float | None = None) -> list[Group]:
        self.worker.start()  # no-op unless this instance is a restart, which nobody else would start
        return await self.worker.get_groups(n, timeout_s)

    async def stats(self) -> dict[str, float]:
        return self.worker.stats()

    async def stop(self) -> None:
        await self.worker.stop()


def resume_state(cfg) -> dict:
    """Where a restarted rollout goes on, from the bucket: the newest checkpoint's data cursor, the newest version.

    Groups trained since that checkpoint may be generated again; the learner, which remembers every
    group id it trained on, skips them, so a restart costs some generation and never trains a group twice."""
    from app.bucket.store import AdapterStore, CheckpointStore

    checkpoints = CheckpointStore.from_config(cfg)
    step = checkpoints.latest()
    meta = checkpoints.manifest(step).get("meta", {}) if step is not None else {}
    versions = [v for v in (AdapterStore.from_config(cfg).latest(), meta.get("policy_version")) if v is not None]
    return {"data_cursor": meta.get("data_cursor") or 0, "policy_version": max(versions, default=0)}
