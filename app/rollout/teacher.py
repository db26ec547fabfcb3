"""The teacher on the rollout side: it scores every sample of a group, token by token, before the group is queued.

On-policy distillation needs the teacher's log-prob of every token the student sampled. Asking for it is
asynchronous I/O through the fleet (or the teacher's own server), so the rollout does it here, between sampling
and the objectives' synchronous `annotate`; the learner never calls a teacher. One request per group: the
G sequences (prompt + completion) as a batch of token-id prompts with `prompt_logprobs: 0` and `max_tokens: 1`,
the request TRL's AsyncDistillationTrainer sends its teacher, at the run's sampling temperature (`grpo.temperature`):
the sampling log-probs it is compared with are taken after temperature, and the fleet scores prompt tokens at the
request's temperature too. The prefix router keeps a group's sequences, which share their prompt, on one replica.
Top-k distillation asks `prompt_logprobs: k` instead and keeps, per model token, the teacher's k most likely ids and
their log-probs too (`TOPK_IDS` / `TOPK_LOGPROBS`, one stream per rank); k + 1 log-probs per token can pass what a
fleet answers in one request, so a group is then scored in several. Multi-turn episodes are scored whole and kept at
the model's tokens only
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
from app.objectives.distill import TEACHER_LOGPROBS, teacher_top_k, topk_stream_names
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


def teacher_topk(
    positions: list[dict[int, float] | None], prompt_len: int, sample: Sample, k: int
) -> tuple[list[list[float]], list[list[float]]]:
    """The teacher's k most likely ids and their log-probs at each completion token of `sample` (`[k][tokens]`, by
    rank; NaN at the observation tokens of an episode), from a scoring with `prompt_logprobs: k`.

    vLLM answers each position's own token beside its top k: k + 1 entries when that token is not among them (then
    it is left out, whatever its log-prob ties with), k when it is."""
    ids: list[list[float]] = [[] for _ in range(k)]
    logprobs: list[list[float]] = [[] for _ in range(k)]
    mask = sample.completion_mask or [1] * len(sample.completion_ids)
    for j, (token, is_model) in enumerate(zip(sample.completion_ids, mask, strict=True)):
        scored = dict(positions[prompt_len + j] or {})
        if is_model:
            if len(scored) == k + 1:
                scored.pop(token, None)
            if len(scored) != k:
                raise ValueError(f"the teacher gave {len(scored)} alternatives for completion token {j}, not {k}")
        top = sorted(scored.items(), key=lambda e: -e[1])
        for r in range(k):
            ids[r].append(float(top[r][0]) if is_model else math.nan)
            logprobs[r].append(float(top[r][1]) if is_model else math.nan)
    return ids, logprobs


def request_batches(sequences: list[list[int]], top_k: int, max_entries: int | None) -> list[list[list[int]]]:
    """The sequences in order, cut into requests that each ask at most `max_entries` log-probs (tokens x (top_k + 1),
    what a fleet bounds, `fleet.max_prompt_logprobs_per_request`): one request unless the top k make a group's too
    large. A sequence beyond the bound alone goes alone (the server says whether it takes it)."""
    if max_entries is None:
        return [sequences]
    batches: list[list[list[int]]] = []
    entries = 0
    for seq in sequences:
        cost = len(seq) * (top_k + 1)
        if not batches or entries + cost > max_entries:
            batches.append([])
            entries = 0
        batches[-1].append(seq)
        entries += cost
    return batches


class TeacherScorer:
    """Writes the teacher's log-probs into every sample of a group (`TEACHER_LOGPROBS`; with `top_k`, its top k
    too) and what it cost into the group (`TEACHER_S`, `TEACHER_TOKENS`). The teacher scores at `temperature`, the
    one the group was sampled at."""

    def __init__(
        self,
        endpoint: TeacherEndpoint,
        client: FleetClient,
        temperature: float = 1.0,
        top_k: int = 0,
        max_entries: int | None = None,
    ):
        self.endpoint, self.client, self.temperature = endpoint, client, temperature
        self.top_k, self.max_entries = top_k, max_entries

    @classmethod
    def from_config(cls, endpoint: TeacherEndpoint, cfg) -> TeacherScorer:
        """The scorer of a run (`RunConfig`): its teacher's timeouts and retries, its sampling temperature, the
        alternatives top-k distillation keeps per token (`teacher_top_k`; 0: the sampled token's alone) and the most
        log-probs one request may ask for (`fleet.max_prompt_logprobs_per_request`)."""
        client = endpoint.client(cfg.teacher.request_timeout_s, cfg.teacher.max_retries)
        return cls(
            endpoint, client, cfg.grpo.temperature, teacher_top_k(cfg), cfg.fleet.max_prompt_logprobs_per_request
        )

    async def score(self, group: Group) -> None:
        sequences = [group.prompt_ids + s.completion_ids for s in group.samples]
        started = time.monotonic()
        scored = []
        for batch in request_batches(sequences, self.top_k, self.max_entries):
            scored += await self._score(batch)  # one after the other: a lost adapter is loaded again once
        if len(scored) != len(sequences):
            raise ValueError(f"the teacher answered {len(scored)} sequences of {len(sequences)}")
        for sample, positions in zip(group.samples, scored, strict=True):
            sample.streams[TEACHER_LOGPROBS] = teacher_logprobs(positions, len(group.prompt_ids), sample)
            if self.top_k:
                ids, logprobs = teacher_topk(positions, len(group.prompt_ids), sample, self.top_k)
                names = topk_stream_names(self.top_k)
                sample.streams.update(zip(names[0] + names[1], ids + logprobs, strict=True))
        group.costs[TEACHER_S] = group.costs.get(TEACHER_S, 0.0) + time.monotonic() - started
        group.costs[TEACHER_TOKENS] = group.costs.get(TEACHER_TOKENS, 0.0) + sum(map(len, sequences))

    async def _score(self, sequences: list[list[int]]) -> list[list[dict[int, float] | None]]:
        try:
            return await self.client.aprompt_logprobs(sequences, self.endpoint.model, self.top_k, self.temperature)
        except FleetError as e:
            if e.status != 404 or self.endpoint.adapter is None:
                raise
        # A replica that restarted holds no teacher adapter (it loads its lineage's versions only): load it again.
        log.warning("the fleet lost the teacher adapter %s: loading it again", TEACHER_ADAPTER)
        await asyncio.to_thread(self.client.load_adapter, TEACHER_ADAPTER, self.endpoint.adapter)
        return await self.client.aprompt_logprobs(sequences, self.endpoint.model, self.top_k, self.temperature)

    async def aclose(self) -> None:
        await self.client.aclose()
        self.client.close()
