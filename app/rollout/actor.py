"""The rollout in Ray: a `GroupProducer` hosted in an actor, talking to the fleet over HTTP.

Kept apart from the producer so that the producer stays plain asyncio. The actor wires it to the
fleet (one `FleetClient`, which owns the retries of generation requests), the task's problems, the
run's sampler (`app.rollout.sampling`), a distilling run's teacher (`app.rollout.teacher`), and where to start: the learner's `ResumePoint` at the start
of a run, or, when Ray restarts the actor, the newest checkpoint in the bucket (`resume_state`).
"""

from __future__ import annotations

import logging
import warnings

import ray

from app.fleet_client import FleetClient
from app.kinds.registry import problems_of, sampler_for
from app.messages import ResumePoint, RolloutStats
from app.rollout.producer import GroupProducer
from app.rollout.teacher import TeacherEndpoint, scorer_for
from contracts.auth import Secret, admin_token
from contracts.retry import Backoff
from contracts.rollouts import RolloutBatch
from core.config import HEAD_NODE

log = logging.getLogger(__name__)


def sampling_client(cfg, fleet_url: str, run_token: Secret | None = None) -> FleetClient:
    """The rollout's fleet client: `rollout.max_retries` retries of what is worth retrying, then the group is lost.

    It carries the run's token on a shared fleet (`app.fleet_run`), else the admin token when there is one: a fleet
    of the run's own needs it for the cuts of partial rollouts (`POST /v1/cut`), and for inference if protected."""
    return FleetClient(
        fleet_url,
        run_token.value if run_token is not None else admin_token(cfg),
        backoff=Backoff(attempts=cfg.rollout.max_retries + 1, first_s=0.2, max_s=5.0),
        timeout_s=cfg.rollout.request_timeout_s,
    )


# On the head node, which cluster.yaml keeps on-demand. Should it restart all the same, Ray retries the
# driver's calls on the new instance, which resumes from the bucket (`resume_state`).
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, resources=HEAD_NODE)
class RolloutActor:
    """Hosts a GroupProducer in Ray: the driver starts it, takes batches and stats, and tells it new versions."""

    def __init__(
        self,
        cfg,
        model_path: str,
        fleet_url: str,
        resume: ResumePoint,
        run_token: Secret | None = None,
        # Where a distilling run's teacher scores, or its several teachers by name (`app.teacher_setup`).
        teacher: TeacherEndpoint | dict[str, TeacherEndpoint] | None = None,
    ):
        from core.models import load_tokenizer, prompt_token_ids

        logging.basicConfig(level=logging.WARNING)
        with warnings.catch_warnings():  # Ray 2.60's own property trips its deprecated `actor_id`
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:
            # `resume` is where the learner stood when the run started: long outdated now.
            resume = resume_state(cfg)
            log.warning("rollout actor restarted: resuming at %s", resume)
        tokenizer = load_tokenizer(model_path)
        self.client = sampling_client(cfg, fleet_url, run_token)

        def prompt_ids(problem):
            return prompt_token_ids(tokenizer, problem.prompt)

        self.producer = GroupProducer(
            cfg,
            problems_of(cfg).train,
            prompt_ids,
            sampler_for(
                cfg,
                tokenizer,
                self.client.acompletions,
                fleet_url=fleet_url,
                token=run_token.value if run_token is not None else admin_token(cfg),
                model_path=model_path,
            ),
            resume=resume,
            retries_done=lambda: self.client.retries_done,
            cut=self.client.acut,
            teacher=scorer_for(cfg, teacher, prompt_ids),
        )

    async def start(self) -> None:
        self.producer.start()

    async def set_policy_version(self, policy_version: int) -> None:
        self.producer.set_policy_version(policy_version)

    async def get_groups(self, n: int, timeout_s: float | None = None) -> RolloutBatch:
        self.producer.start()  # no-op unless this instance is a restart, which nobody else would start
        return await self.producer.get_groups(n, timeout_s)

    async def stats(self) -> RolloutStats:
        return self.producer.stats()

    async def stop(self) -> None:
        await self.producer.stop()
        await self.client.aclose()


def resume_state(cfg) -> ResumePoint:
    """Where a restarted rollout goes on, from the bucket: the newest checkpoint's data cursor, the newest version.

    Groups trained since that checkpoint may be generated again; the learner, which remembers every
    group id it trained on, skips them, so a restart costs some generation and never trains a group twice."""
    from core.bucket.store import AdapterStore, CheckpointStore

    checkpoints = CheckpointStore.from_config(cfg)
    step = checkpoints.latest()
    meta = checkpoints.manifest(step).get("meta", {}) if step is not None else {}
    versions = [v for v in (AdapterStore.from_config(cfg).latest(), meta.get("policy_version")) if v is not None]
    return ResumePoint(
        step=step or 0, policy_version=max(versions, default=0), data_cursor=meta.get("data_cursor") or 0
    )
