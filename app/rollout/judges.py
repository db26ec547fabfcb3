"""Judges as reward functions: a model scores each sample of a group, through the run's own fleet client.

A `JudgeReward` is called as every reward function is (`app.tasks.rewards`: by keyword, once per group, in a worker
thread of the run's `RewardScorer`) and asks its judge once per group: one request whose prompts are the group's
samples, each shown to the judge by the judge's template (`core.config.judges`). A sample is a completion, or an
episode of an environment (`app.kinds`: its prompt and completion as chat messages, the model's turns and the
environment's or tools' replies); `{transcript}` shows the whole of it, one line per turn (`role: text`), and
`{completion}` its last turn. A judge on the run's fleet goes
through the fleet with the run's token, as the rollout's generations do, so that its requests count in the run's
fair share and the fleet's check of what the run may use applies: a run's token may use the base model, its own
adapters and the fleet's deployments, never another run's adapter (403, `deployments.api.callers`).
`app.rollout.judge_probe` asks each judge once at start, so that such a refusal, or a judge that is not there, ends
the run in one line before it trains.

Verdicts: a `generative` judge writes its answer, read as yes/no (its first word) or by a regular expression whose
first group is the score; a `logprob` judge is scored, not sampled: each sample's prompt followed by the "yes" token
(and by the "no" token) in one `prompt_logprobs` request, the score p(yes) / (p(yes) + p(no)).

A judge that raises (the fleet refused, gave up after its retries, answered something malformed) or times out scores
the group's samples `fallback_score`, or, with `on_failure: drop`, raises on to the scorer, which gives them None
(nothing) and counts the failure against the judge (`reward/errors/<name>`), so that the rollout drops the group
(`app.rollout.producer`); a verdict that cannot be read scores `unparseable_score`. Both are counted:
`judge/<name>/failed`, `judge/<name>/unparseable`, and over every judge `judge/failed_total` (the samples a judge did
not score), beside `judge/<name>/requests`, `judge/<name>/samples` and `judge/<name>/seconds`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import string
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from app.fleet_client import FleetClient
from app.rollout.teacher import request_batches
from app.tasks.problems import Problem
from app.tasks.rewards import RewardScorer, resolve_reward
from contracts.retry import Backoff
from core.config.context import template_fields
from core.config.judges import RETRY_PAUSE_MAX_S, GenerativeVerdict, JudgeConfig, LogprobVerdict

log = logging.getLogger(__name__)

JUDGE_TOKEN_ENV = "SPOTRL_JUDGE_TOKEN"  # the bearer token of a judge `url`, if its server wants one
# What every template may name besides the problems' columns.
FIXED_FIELDS = ("prompt", "completion", "transcript", "reference")
FAILED_TOTAL = "judge/failed_total"
_FIRST_WORD = re.compile(r"[A-Za-z]+")


def last_text(value: Any) -> str:
    """A prompt or a completion as the judge reads it: text as is; chat messages by the last one's text (an episode's
    last turn)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], Mapping):
        return message_text(value[-1])
    return str(value)


def messages(value: Any, role: str) -> list[Mapping]:
    """A prompt or a completion as chat messages: text is one message of `role` (a prompt the user's, a completion
    the assistant's), messages as they are."""
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return value
    return [{"role": role, "content": value if isinstance(value, str) else str(value)}]


def message_text(message: Mapping) -> str:
    """A message's text as the judge reads it: its content (the text parts of a list of parts), then each tool it
    calls as `name(arguments)`, since a tool-calling turn may say nothing else."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    text = "" if content is None else str(content)
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else {}
        arguments = function.get("arguments", {})
        shown = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        text += f"{' ' if text else ''}{function.get('name', 'unknown')}({shown})"
    return text


def transcript(prompt: Any, completion: Any) -> str:
    """The whole sample as the judge reads it, one line per message in order, `role: text`: the prompt's messages,
    then the completion's (an episode's turns: the model's, the environment's or its tools' replies). A single-turn
    sample is two lines, `user: <prompt>` and `assistant: <completion>`."""
    shown = [*messages(prompt, "user"), *messages(completion, "assistant")]
    return "\n".join(f"{m.get('role', 'user')}: {message_text(m)}" for m in shown)


def check_template(name: str, template: str, problems: list[Problem]) -> None:
    """ValueError (one line, naming the judge and the field) when `template` names a field that a problem of the task
    does not have: `prompt`, `completion`, `transcript`, `reference` (a task's gold answer, which every problem must
    give) or a column of the problems."""
    names = template_fields(template)
    for problem in problems:
        missing = sorted(n for n in names if n not in FIXED_FIELDS and n not in problem.columns)
        if missing:
            known = ", ".join(sorted(set(FIXED_FIELDS) | set(problem.columns)))
            raise ValueError(
                f"judges.{name}.template names {', '.join(missing)}, which problem {problem.id!r} of the task does not "
                f"have (it has: {known})"
            )
        if "reference" in names and problem.answer in ("", None):
            raise ValueError(f"judges.{name}.template names reference; problem {problem.id!r} has no answer to show")


def render(template: str, prompt: Any, completion: Any, reference: Any, columns: Mapping[str, Any]) -> str:
    """The judge's prompt for one sample: `template` filled with the problem's columns, its prompt's text, the
    sample's completion (an episode's last turn), the whole of it (`transcript`) and the gold answer (`reference`)."""
    values = {
        **columns,
        "prompt": last_text(prompt),
        "completion": last_text(completion),
        "transcript": transcript(prompt, completion),
        "reference": reference,
    }
    return string.Formatter().vformat(template, (), values)


def parse_generative(text: str, verdict: GenerativeVerdict) -> float | None:
    """A generated verdict's score, or None when it cannot be read: yes_no reads the first word (yes 1, no 0, any
    case), regex the number its pattern's first group holds at the last match."""
    if verdict.parse == "yes_no":
        word = _FIRST_WORD.search(text)
        return {"yes": 1.0, "no": 0.0}.get(word.group(0).lower()) if word else None
    matches = list(re.finditer(verdict.pattern or "", text))
    if not matches:
        return None
    try:
        score = float(matches[-1].group(1))
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None


def logprob_score(yes: float, no: float | None) -> float:
    """The score of a log-prob verdict: p(yes), or p(yes) / (p(yes) + p(no)) with a "no" token; ValueError when the
    judge ruled both out (-inf) or gave no number."""
    if math.isnan(yes) or (no is not None and math.isnan(no)):
        raise ValueError("the judge gave no log-prob for its verdict tokens")
    if no is None:
        return math.exp(yes)
    top = max(yes, no)
    if top == -math.inf:
        raise ValueError("the judge ruled out both verdict tokens")
    return 1.0 / (1.0 + math.exp(no - yes)) if yes > -math.inf else 0.0


def one_token(tokenizer, text: str, where: str) -> int:
    """The id of `text`, one token of `tokenizer`; ValueError naming `where` else."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{where}={text!r} is {len(ids)} tokens of the judge's tokenizer; name one token")
    return ids[0]


@dataclass(frozen=True)
class VerdictIds:
    """A logprob verdict's token ids in the run's tokenizer: its "yes", and its "no" (None without a no_token)."""

    yes: int
    no: int | None


def verdict_token_ids(tokenizer, name: str, verdict: LogprobVerdict) -> VerdictIds:
    """A logprob verdict's "yes" and "no" token ids; ValueError naming the setting that is not one token of
    `tokenizer`."""
    yes = one_token(tokenizer, verdict.yes_token, f"judges.{name}.verdict.yes_token")
    if verdict.no_token is None:
        return VerdictIds(yes, None)
    return VerdictIds(yes, one_token(tokenizer, verdict.no_token, f"judges.{name}.verdict.no_token"))


def rewarding_judges(cfg) -> dict[str, JudgeConfig]:
    """The judges the run's `task.reward_funcs` names, by name, in its order, each once."""
    return {name: cfg.judges[name] for name in cfg.task.reward_funcs if name in cfg.judges}


def used_judges(cfg) -> dict[str, JudgeConfig]:
    """The judges the run rewards with or measures its held-out split with (`eval.reward_funcs`), by name, each once:
    what is checked and asked at start."""
    names = [*cfg.task.reward_funcs, *(cfg.eval.reward_funcs or ())]
    return {name: cfg.judges[name] for name in names if name in cfg.judges}


def task_rewards(cfg, fleet_url: str, token: str | None, tokenizer=None) -> list:
    """`task.reward_funcs` as the scorer calls them, in their order: each judge a `JudgeReward` asked through the run's
    fleet seat (`fleet_url`, `token`), each other name its reward function."""
    judges = judge_rewards(cfg, fleet_url, token, tokenizer)
    return [judges[name] if name in judges else resolve_reward(name) for name in cfg.task.reward_funcs]


def scoring_workers(cfg, funcs: list) -> int:
    """Reward calls a scorer of `funcs` runs at once: a judge's call mostly waits on the fleet, so with one as many as
    groups in flight, or they queue behind two."""
    return cfg.rollout.max_inflight_tasks if any(isinstance(f, JudgeReward) for f in funcs) else 2


def episode_judges(cfg, fleet_url: str, token: str | None, tokenizer=None) -> RewardScorer | None:
    """The scorer of the judges `task.reward_funcs` names, each weighted as there (`task.reward_weights`), for a kind
    whose environment rewards its episodes itself (`app.rollout.episodes`): its other names are not called there.
    None when it names no judge."""
    judges = judge_rewards(cfg, fleet_url, token, tokenizer)
    if not judges:
        return None
    named = [(name, w) for name, w in zip(cfg.task.reward_funcs, cfg.task.weights(), strict=True) if name in judges]
    funcs = [judges[name] for name, _ in named]
    return RewardScorer(
        funcs, cfg.task.reward_timeout_s, cfg.train.max_steps, scoring_workers(cfg, funcs), [w for _, w in named]
    )


def judge_client(
    judge: JudgeConfig, fleet_url: str, token: str | None, transport: httpx.BaseTransport | None = None
) -> FleetClient:
    """The judge's client: the run's fleet at `fleet_url` with the run's `token`, or the judge's `url` with
    SPOTRL_JUDGE_TOKEN; its requests time out after `timeout_s`, each retried `max_retries` times (`transport`, as
    `FleetClient`'s, lets tests talk to an app in-process)."""
    backoff = Backoff(attempts=judge.max_retries + 1, first_s=0.2, max_s=RETRY_PAUSE_MAX_S)
    if judge.url is not None:
        url, token = judge.url, os.environ.get(JUDGE_TOKEN_ENV) or None
    else:
        url = fleet_url
    return FleetClient(url, token, timeout_s=judge.timeout_s, backoff=backoff, transport=transport)


class JudgeReward:
    """A reward function (TRL's call: `prompts=`, `completions=`, the problems' columns) that asks judge `name`.

    Thread-safe: the scorer calls it from several threads at once, one group each."""

    def __init__(
        self,
        name: str,
        judge: JudgeConfig,
        client: FleetClient,
        tokenizer=None,
        max_entries: int | None = None,
    ):
        self.__name__ = name  # what the scorer names its failures by, as a function's
        self.name, self.judge, self.client, self.max_entries = name, judge, client, max_entries
        # How a verdict is read: the generated text by its settings, or the log-probs of these token ids (a logprob
        # verdict's, found once, here: one field, so that a logprob judge always has its ids).
        self._reading: GenerativeVerdict | VerdictIds
        if isinstance(judge.verdict, LogprobVerdict):
            if tokenizer is None:
                raise ValueError(f"judges.{name}: a logprob verdict needs the run's tokenizer")
            self._reading = verdict_token_ids(tokenizer, name, judge.verdict)
        else:
            self._reading = judge.verdict
        self.tokenizer = tokenizer
        self._model: str | None = None if judge.model == "base" else judge.model
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    def model(self) -> str:
        """The model the judge asks for: its own name, or the name the fleet serves its base model under."""
        with self._lock:
            if self._model is None:
                self._model = next(m["id"] for m in self.client.models() if m.get("parent") is None)
            return self._model

    def __call__(self, prompts: list, completions: list, answer: list | None = None, **columns: Any) -> list[float]:
        n = len(completions)
        answers = answer if answer is not None else [None] * n
        started = time.monotonic()
        try:
            texts = [
                render(self.judge.template, p, c, a, {k: v[i] for k, v in columns.items() if isinstance(v, list)})
                for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True))
            ]
            verdicts = self.verdicts(texts)
        except Exception as e:  # the fleet's refusal, retries spent, a timeout, a malformed answer: the group's only
            self._count(n, failed=n, seconds=time.monotonic() - started)
            if self.judge.on_failure == "drop":  # the scorer counts it against the judge, the rollout drops the group
                raise
            log.warning("judge %s: %s: %s; its %d samples score %s", self.name, type(e).__name__, e, n, self.fallback)
            return [self.fallback] * n
        unreadable = sum(v is None for v in verdicts)
        self._count(n, unparseable=unreadable, seconds=time.monotonic() - started)
        return [self.unreadable if v is None else v for v in verdicts]

    @property
    def fallback(self) -> float:
        return self.judge.fallback_score

    @property
    def unreadable(self) -> float:
        verdict = self.judge.verdict
        return verdict.unparseable_score if isinstance(verdict, GenerativeVerdict) else self.judge.fallback_score

    def verdicts(self, texts: list[str]) -> list[float | None]:
        """Each judge prompt's score (None: a generated verdict that cannot be read), in one request per group (a
        log-prob verdict's cut where the fleet bounds the log-probs of a request); raises what the client raises."""
        reading = self._reading
        if isinstance(reading, GenerativeVerdict):
            choices = self.client.completions(
                texts, self.model(), n=1, max_tokens=reading.max_tokens, temperature=reading.temperature
            )
            self._count(0, requests=1)
            if len(choices) != len(texts):
                raise ValueError(f"the judge answered {len(choices)} verdicts for {len(texts)} samples")
            return [parse_generative(c.text, reading) for c in choices]
        yes, no = reading.yes, reading.no
        prompts = [self._prompt_ids(t) for t in texts]
        sequences = [p + [yes] for p in prompts] + ([p + [no] for p in prompts] if no is not None else [])
        scored: list[list[dict[int, float] | None]] = []
        for batch in request_batches(sequences, 0, self.max_entries):
            scored += self.client.prompt_logprobs(batch, self.model())
            self._count(0, requests=1)
        if len(scored) != len(sequences):
            raise ValueError(f"the judge scored {len(scored)} sequences of {len(sequences)}")
        last = [(positions[-1] or {}).get(seq[-1], math.nan) for positions, seq in zip(scored, sequences, strict=True)]
        n = len(texts)
        return [logprob_score(last[i], last[n + i] if no is not None else None) for i in range(n)]

    def _prompt_ids(self, text: str) -> list[int]:
        from core.models import prompt_token_ids

        return prompt_token_ids(self.tokenizer, text)

    def _count(
        self, samples: int, *, requests: int = 0, failed: int = 0, unparseable: int = 0, seconds: float = 0.0
    ) -> None:
        with self._lock:
            self.counts.update({"samples": samples, "requests": requests, "failed": failed, "unparseable": unparseable})
            self.counts["seconds"] += seconds

    def metrics(self) -> dict[str, float]:
        """The judge's counts so far (`judge/<name>/...`), and the samples it did not score (`judge/failed_total`:
        the scorer sums this key over its judges)."""
        with self._lock:
            counts = dict(self.counts)
        kept = ("requests", "samples", "failed", "unparseable", "seconds")
        out = {f"judge/{self.name}/{k}": float(counts.get(k, 0)) for k in kept}
        out[FAILED_TOTAL] = float(counts.get("failed", 0) + counts.get("unparseable", 0))
        return out

    def probe(self) -> None:
        """Ask the judge once, as the rollout will (the fleet's refusal of a model the run may not use, a model
        that is not there, a server that does not answer all raise here)."""
        columns = dict.fromkeys(template_fields(self.judge.template), "probe")
        probe = render(self.judge.template, "probe", "probe", "probe", columns)
        if isinstance(self._reading, GenerativeVerdict):
            self.client.completions([probe], self.model(), n=1, max_tokens=1, temperature=0.0)
        else:
            self.client.prompt_logprobs([self._prompt_ids(probe) + [self._reading.yes]], self.model())

    def close(self) -> None:
        self.client.close()


def judge_rewards(
    cfg,
    fleet_url: str,
    token: str | None,
    tokenizer=None,
    transport: httpx.BaseTransport | None = None,
    judges: Mapping[str, JudgeConfig] | None = None,
) -> dict[str, JudgeReward]:
    """`judges` (by default those the run's `task.reward_funcs` names) as rewards, by name, each with a client of its
    own."""
    return {
        name: JudgeReward(
            name,
            judge,
            judge_client(judge, fleet_url, token, transport),
            tokenizer,
            cfg.fleet.max_prompt_logprobs_per_request,
        )
        for name, judge in (rewarding_judges(cfg) if judges is None else judges).items()
    }


def judge_agreement(
    judge: JudgeReward, problems: list[Problem], seen: list[tuple[Any, Any]], solved: list[bool]
) -> float:
    """Share of held-out samples on which the judge's verdict (a score over one half: right) is the evaluation's
    (`solved`, by `eval.reward_funcs`): how far a judged run's reward can be trusted. Each sample is shown to the judge
    as `seen` gives it, a (prompt, completion) pair as in training: an episode's completion is its messages, which
    `{transcript}` shows turn by turn and `{completion}` by its last. An unreadable verdict counts as the score it
    trains with; raises what the judge's client raises."""
    texts = [
        render(judge.judge.template, prompt, completion, p.answer, p.columns)
        for p, (prompt, completion) in zip(problems, seen, strict=True)
    ]
    scores = [judge.unreadable if v is None else v for v in judge.verdicts(texts)]
    return sum((s > 0.5) == ok for s, ok in zip(scores, solved, strict=True)) / len(solved)
