"""The teacher on the rollout side: it scores every sample of a group, token by token, before the group is queued.

On-policy distillation needs the teacher's log-prob of every token the student sampled. Asking for it is
asynchronous I/O through the fleet (or the teacher's own server), so the rollout does it here, between sampling
and the objectives' synchronous `annotate`; the learner never calls a teacher. One request per group: the
G sequences (prompt + completion) as a batch of token-id prompts with `prompt_logprobs: 0` and `max_tokens: 1`,
the request TRL's AsyncDistillationTrainer sends its teacher, at the run's sampling temperature (`grpo.temperature`):
the sampling log-probs it is compared with are taken after temperature, and the fleet scores prompt tokens at the
request's temperature too. The prefix router keeps a group's sequences, which share their prompt, on one replica. Multi-turn episodes are scored whole and kept at the model's tokens only
(NaN at observations, which nothing trains). A teacher that fails after its retries, or times out, raises: the
producer drops and counts the group, never the run. An adapter teacher that a replica lost (a restart) is
loaded again once before its group is given up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from app.fleet_client import FleetClient, FleetError
from app.objectives.distill import TEACHER_LOGPROBS
from contracts.auth import Secret
from contracts.retry import Backoff
from contracts.rollouts import Group, Sample
from core.config.teacher import TEACHER_ADAPTER

log = logging.getLogger(__name__)

TEACHER_TOKEN_ENV = "SPOTRL_TEACHER_TOKEN"  # the bearer token of a teacher `url`, if its server wants one
TEACHER_S = "distill/teacher_s"  # seconds the teacher took to score a step's groups (summed over groups)
TEACHER_TOKENS = "distill/teacher_tokens"  # tokens it scored for them (prompts and completions)


@dataclass(frozen=True)
class TeacherEndpoint:
    """Where the run's teacher answers, and under which model name: what the driver resolved and checked at start
    (`app.teacher_setup`) and hands the rollout and the evaluation."""

    kind: str  # base, adapter, model or url (`core.config.teacher`)
    url: str  # the base URL of the server that scores: the run's fleet, or the teacher's own
    model: str  # the model name to ask it for
    token: Secret | None = None
    adapter: str | None = None  # an adapter teacher's source, to load it again where a replica lost it

    def client(self, timeout_s: float, retries: int) -> FleetClient:
        backoff = Backoff(attempts=retries + 1, first_s=0.2, max_s=5.0)
        return FleetClient(self.url, self.token.value if self.token else None, timeout_s=timeout_s, backoff=backoff)


def teacher_logprobs(positions: list[dict[int, float] | None], prompt_len: int, sample: Sample) -> list[float]:
    """The teacher's log-prob of each completion token of `sample` from its scoring of prompt + completion
    (`positions[i]` scores token i), NaN at the observation tokens of an episode."""
    if len(positions) != prompt_len + len(sample.completion_ids):
        raise ValueError(f"the teacher scored {len(positions)} positions of {prompt_len + len(sample.completion_ids)}")
    mask = sample.completion_mask or [1] * len(sample.completion_ids)
    out = []
    for j, (token, is_model) in enumerate(zip(sample.completion_ids, mask, strict=True)):
        if not is_model:
            out.append(math.nan)
            continue
        scored = positions[prompt_len + j] or {}
        if token not in scored or math.isnan(scored[token]):  # -inf is a score: the teacher rules the token out
            raise ValueError(f"the teacher gave no log-prob for completion token {j} ({token})")
        out.append(float(scored[token]))
    return out


class TeacherScorer:
    """Writes the teacher's log-probs into every sample of a group (`TEACHER_LOGPROBS`) and what it cost into
    the group (`TEACHER_S`, `TEACHER_TOKENS`). The teacher scores at `temperature`, the one the group was sampled at."""

    def __init__(self, endpoint: TeacherEndpoint, client: FleetClient, temperature: float = 1.0):
        self.endpoint, self.client, self.temperature = endpoint, client, temperature

    @classmethod
    def from_config(cls, endpoint: TeacherEndpoint, cfg) -> TeacherScorer:
        """The scorer of a run (`RunConfig`): its teacher's timeouts and retries, its sampling temperature."""
        client = endpoint.client(cfg.teacher.request_timeout_s, cfg.teacher.max_retries)
        return cls(endpoint, client, cfg.grpo.temperature)

    async def score(self, group: Group) -> None:
        sequences = [group.prompt_ids + s.completion_ids for s in group.samples]
        started = time.monotonic()
        scored = await self._score(sequences)
        if len(scored) != len(sequences):
            raise ValueError(f"the teacher answered {len(scored)} sequences of {len(sequences)}")
        for sample, positions in zip(group.samples, scored, strict=True):
            sample.streams[TEACHER_LOGPROBS] = teacher_logprobs(positions, len(group.prompt_ids), sample)
        group.costs[TEACHER_S] = group.costs.get(TEACHER_S, 0.0) + time.monotonic() - started
        group.costs[TEACHER_TOKENS] = group.costs.get(TEACHER_TOKENS, 0.0) + sum(map(len, sequences))

    async def _score(self, sequences: list[list[int]]) -> list[list[dict[int, float] | None]]:
        try:
            return await self.client.aprompt_logprobs(sequences, self.endpoint.model, temperature=self.temperature)
        except FleetError as e:
            if e.status != 404 or self.endpoint.adapter is None:
                raise
        # A replica that restarted holds no teacher adapter (it loads its lineage's versions only): load it again.
        log.warning("the fleet lost the teacher adapter %s: loading it again", TEACHER_ADAPTER)
        await asyncio.to_thread(self.client.load_adapter, TEACHER_ADAPTER, self.endpoint.adapter)
        return await self.client.aprompt_logprobs(sequences, self.endpoint.model, temperature=self.temperature)

    async def aclose(self) -> None:
        await self.client.aclose()
        self.client.close()
