"""The teacher on the rollout side: it scores every sample of a group, token by token, before the group is queued.

On-policy distillation needs the teacher's log-prob of every token the student sampled. Asking for it is
asynchronous I/O through the fleet (or the teacher's own server), so the rollout does it here, between sampling
and the objectives' synchronous `annotate`; the learner never calls a teacher. One request per group: the
G sequences (prompt + completion) as a batch of token-id prompts with `prompt_logprobs: 0` and `max_tokens: 1`,
the request TRL's AsyncDistillationTrainer sends its teacher, at the run's sampling temperature (`sampling.temperature`):
the sampling log-probs it is compared with are taken after temperature, and the fleet scores prompt tokens at the
request's temperature too. The prefix router keeps a group's sequences, which share their prompt, on one replica.
Top-k distillation asks `prompt_logprobs: k` instead and keeps, per model token, the teacher's k most likely ids and
their log-probs too (`TOPK_IDS` / `TOPK_LOGPROBS`, one stream per rank); k + 1 log-probs per token can pass what a
fleet answers in one request, so a group is then scored in several. Multi-turn episodes are scored whole and kept at
the model's tokens only (NaN at observations, which nothing trains).

A self teacher (self-distillation) scores the student's completion under another prompt, the privileged one
(`app.tasks.privileged`: the problem's prompt with its answer, solution or an episode's feedback): the sequences
are the teacher's prompt + the student's completion, and the completion's log-probs are read after the teacher's
prompt, whatever its length. A `live` self teacher is the run's newest version, named per group by the rollout; an
`ema` one the same number of the run's ema lineage (`ema-vN`, the learner's average, published beside `policy-vN`). A
teacher that fails after its retries, or times out, raises: the
producer drops and counts the group, never the run. An adapter teacher that a replica lost (a restart) is
loaded again once before its group is given up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.fleet_client import FleetClient, FleetError
from app.objectives.distill import TEACHER_INDEX, TEACHER_LOGPROBS, teacher_metric, teacher_top_k, topk_stream_names
from app.tasks.privileged import privileged_problem
from app.tasks.problems import Problem
from contracts.adapters import EMA_STEM, in_lineage
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

    kind: str  # base, adapter, model, url or self (`core.config.teacher`)
    url: str  # the base URL of the server that scores: the run's fleet, or the teacher's own
    model: str  # the model name to ask it for (a `live` self teacher's: the version it was checked with)
    token: Secret | None = None
    adapter: str | None = None  # an adapter teacher's source, to load it again where a replica lost it
    context: str | None = None  # a self teacher's privileged prompt template; None: the student's own prompt
    live: bool = False  # a self teacher that scores with the run's newest version, named per group
    ema: bool = False  # a live one that scores with the newest version's number of the run's ema lineage
    feedback: bool = True  # a self teacher's `{feedback}`: a failed episode's last word from its environment
    name: str | None = None  # its name among several teachers (`teachers:`)

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


def sample_feedback(sample: Sample) -> str:
    """What a self teacher's `{feedback}` shows of a sample: what the environment said last of a failed episode (its
    last observation, or its error); nothing for one that succeeded, nor for a single completion."""
    if sample.turn_rewards is None and not sample.env_error:
        return ""
    return "" if sample.succeeded else sample.feedback


class TeacherScorer:
    """Writes the teacher's log-probs into every sample of a group (`TEACHER_LOGPROBS`; with `top_k`, its top k
    too) and what it cost into the group (`TEACHER_S`, `TEACHER_TOKENS`). The teacher scores at `temperature`, the
    one the group was sampled at; a self teacher's prompts are tokenised by `prompt_ids`, as the student's are."""

    def __init__(
        self,
        endpoint: TeacherEndpoint,
        client: FleetClient,
        prompt_ids: Callable[[Problem], list[int]] | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        max_entries: int | None = None,
    ):
        if endpoint.context is not None and prompt_ids is None:
            raise ValueError("a self teacher's privileged prompts need the student's tokenisation (prompt_ids)")
        self.endpoint, self.client, self.prompt_ids, self.temperature = endpoint, client, prompt_ids, temperature
        self.top_k, self.max_entries = top_k, max_entries

    @classmethod
    def from_config(
        cls,
        endpoint: TeacherEndpoint,
        cfg,
        prompt_ids: Callable[[Problem], list[int]] | None = None,
        teacher_cfg=None,
    ) -> TeacherScorer:
        """The scorer of a run (`RunConfig`): its teacher's (`teacher_cfg`, by default the run's one) timeouts and
        retries, its sampling temperature, the alternatives top-k distillation keeps per token (`teacher_top_k`; 0:
        the sampled token's alone) and the most log-probs one request may ask for
        (`fleet.max_prompt_logprobs_per_request`)."""
        teacher_cfg = teacher_cfg or cfg.teacher
        client = endpoint.client(teacher_cfg.request_timeout_s, teacher_cfg.max_retries)
        return cls(
            endpoint,
            client,
            prompt_ids,
            cfg.sampling.temperature,
            teacher_top_k(cfg),
            cfg.fleet.max_prompt_logprobs_per_request,
        )

    def teacher_prompts(self, group: Group, problem: Problem | None) -> list[list[int]]:
        """The prompt the teacher is shown before each sample's completion: the student's, or a self teacher's
        privileged one; with `{feedback}`, a failed episode's shows what the environment said of it (SDPO), each
        distinct one tokenised once."""
        if self.endpoint.context is None:
            return [group.prompt_ids] * len(group.samples)
        if problem is None:
            raise ValueError(f"group {group.group_id}: a self teacher needs the group's problem")
        prompts: dict[str, list[int]] = {}
        out = []
        for sample in group.samples:
            said = sample_feedback(sample) if self.endpoint.feedback else ""
            if said not in prompts:
                prompts[said] = self.prompt_ids(privileged_problem(self.endpoint.context, problem, said))
            out.append(prompts[said])
        return out

    async def score(self, group: Group, problem: Problem | None = None, newest_model: str | None = None) -> None:
        """Score every sample of `group` (of `problem`; a `live` self teacher scores with `newest_model`, the run's
        newest version, an `ema` one with that version's number of the run's ema lineage)."""
        prompts = self.teacher_prompts(group, problem)
        sequences = [p + s.completion_ids for p, s in zip(prompts, group.samples, strict=True)]
        model = self.endpoint.model
        if self.endpoint.live:
            if newest_model is None:
                raise ValueError(f"group {group.group_id}: a live self teacher needs the run's newest version")
            model = in_lineage(newest_model, EMA_STEM) if self.endpoint.ema else newest_model
        started = time.monotonic()
        scored = []
        for batch in request_batches(sequences, self.top_k, self.max_entries):
            scored += await self._score(batch, model)  # one after the other: a lost adapter is loaded again once
        if len(scored) != len(sequences):
            raise ValueError(f"the teacher answered {len(scored)} sequences of {len(sequences)}")
        for sample, prompt, positions in zip(group.samples, prompts, scored, strict=True):
            sample.streams[TEACHER_LOGPROBS] = teacher_logprobs(positions, len(prompt), sample)
            if self.top_k:
                ids, logprobs = teacher_topk(positions, len(prompt), sample, self.top_k)
                names = topk_stream_names(self.top_k)
                sample.streams.update(zip(names[0] + names[1], ids + logprobs, strict=True))
        group.costs[TEACHER_S] = group.costs.get(TEACHER_S, 0.0) + time.monotonic() - started
        group.costs[TEACHER_TOKENS] = group.costs.get(TEACHER_TOKENS, 0.0) + sum(map(len, sequences))

    async def _score(self, sequences: list[list[int]], model: str) -> list[list[dict[int, float] | None]]:
        try:
            return await self.client.aprompt_logprobs(sequences, model, self.top_k, self.temperature)
        except FleetError as e:
            if e.status != 404 or self.endpoint.adapter is None:
                raise
        # A replica that restarted holds no teacher adapter (it loads its lineage's versions only): load it again.
        log.warning("the fleet lost the teacher adapter %s: loading it again", TEACHER_ADAPTER)
        await asyncio.to_thread(self.client.load_adapter, TEACHER_ADAPTER, self.endpoint.adapter)
        return await self.client.aprompt_logprobs(sequences, model, self.top_k, self.temperature)

    async def aclose(self) -> None:
        await self.client.aclose()
        self.client.close()


class TeacherChoice:
    """Several teachers (multi-teacher distillation): each group is scored by the teacher its problem names in its
    `field` column (the one named `default` where it names none). Each sample carries the chosen teacher's index
    among the sorted names (`TEACHER_INDEX`), so that the learner reports the reverse KL per teacher; what each
    teacher cost and how many groups its failures cost are counted under its name."""

    def __init__(self, scorers: dict[str, TeacherScorer], field: str, default: str = "default"):
        self.scorers, self.field, self.default = scorers, field, default
        self.names = sorted(scorers)
        self.failed = dict.fromkeys(self.names, 0)

    def pick(self, problem: Problem) -> str:
        name = problem.columns.get(self.field, self.default)
        if name not in self.scorers:
            raise ValueError(f"problem {problem.id!r} names teacher {name!r}, which the run does not have")
        return name

    async def score(self, group: Group, problem: Problem | None = None, newest_model: str | None = None) -> None:
        if problem is None:
            raise ValueError(f"group {group.group_id}: several teachers need the group's problem to choose one")
        name = self.pick(problem)
        before = dict(group.costs)
        try:
            await self.scorers[name].score(group, problem, newest_model)
        except Exception:
            self.failed[name] += 1
            raise
        for metric in (TEACHER_S, TEACHER_TOKENS):
            spent = group.costs.get(metric, 0.0) - before.get(metric, 0.0)
            own = teacher_metric(metric, name)
            group.costs[own] = group.costs.get(own, 0.0) + spent
        index = float(self.names.index(name))
        for sample in group.samples:
            sample.streams[TEACHER_INDEX] = [index] * len(sample.completion_ids)

    def failed_by_teacher(self) -> dict[str, int]:
        return dict(self.failed)

    async def aclose(self) -> None:
        for scorer in self.scorers.values():
            await scorer.aclose()


def scorer_for(
    cfg, endpoints: TeacherEndpoint | dict[str, TeacherEndpoint] | None, prompt_ids: Callable[[Problem], list[int]]
) -> TeacherScorer | TeacherChoice | None:
    """What scores a distilling run's groups: its one teacher's scorer, or a choice among several (`teachers:`)."""
    if endpoints is None:
        return None
    if isinstance(endpoints, TeacherEndpoint):
        return TeacherScorer.from_config(endpoints, cfg, prompt_ids)
    teachers = cfg.teachers
    if cfg.distill.teachers is None:
        ((name, endpoint),) = endpoints.items()
        return TeacherScorer.from_config(endpoint, cfg, prompt_ids, teachers[name])
    scorers = {n: TeacherScorer.from_config(e, cfg, prompt_ids, teachers[n]) for n, e in endpoints.items()}
    return TeacherChoice(scorers, cfg.distill.teacher_field)
