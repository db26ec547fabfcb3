"""Reward functions and the scorer that sums them without ever stopping a run.

Reward functions are called as TRL 1.16 calls them (`GRPOTrainer._calculate_rewards`), by keyword only:
`prompts=`, `completions=`, `completion_ids=`, the dataset's columns, `trainer_state=`, `log_extra=`,
`log_metric=` (and `environments=` for a TRL environment's episodes), so a function written for TRL, in whatever
order it names its parameters, drops in unchanged; each returns one float (or None) per sample. The scorer
sums them like TRL, each times its weight (`task.reward_weights`, TRL's `reward_weights`; a None contributes
nothing, as TRL's `nansum`); a function that raises or runs past its timeout
(counted from when it starts) gives None for its samples and is counted in `reward/errors/<name>` instead of
killing the run; a call that hangs leaves its thread behind (`app.tasks.timed_calls`), never takes one of the
scorer's for good.

The MATH reward checks the last `\\boxed{}` with math-verify, whose own timeouts rely on signals,
so it runs in a process pool (signals only work in a process's main thread) with an outer timeout.

The reasoning-gym reward is the library's own: each dataset scores its entries with its `score_answer`, which
may give partial credit; one that raises scores its sample 0 and is logged, so the other samples of the batch
keep their scores and the run goes on.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import inspect
import logging
import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from app.tasks.problems import ANSWER_OPEN
from app.tasks.registry import resolve_named
from app.tasks.timed_calls import TimedCalls

log = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]
_TRANSFORMERS_IMPORT = threading.Lock()


@runtime_checkable
class CountsItself(Protocol):
    """A reward function that keeps counters of its own (a judge: its requests, failures), reported with the run's."""

    def metrics(self) -> dict[str, float]: ...


def exact_answer(completions, prompts, completion_ids, answer, **_) -> list[float]:
    """1.0 when the completion, stripped, is exactly the gold answer."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _verify_boxed(gold: str, boxed: str) -> float:
    """Runs in a pool worker: math-verify's parse and verify (signal-based timeouts work here)."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$" if "$" not in gold and "\\boxed" not in gold else gold)
    pred_parsed = parse(f"\\boxed{{{boxed}}}")
    return float(bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed))


class MathVerifier:
    """A process pool for math-verify, restarted when a check hangs past its timeout."""

    def __init__(self, workers: int = 1, timeout_s: float = 5.0):
        self.workers, self.timeout_s = workers, timeout_s
        self._pool: cf.ProcessPoolExecutor | None = None

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx)
        return self._pool

    def _reset(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def check(self, golds: list[str], boxed: list[str | None]) -> list[float]:
        """1.0 per equivalent answer; a missing box is 0; a check that times out scores 0."""
        pool = self._get_pool()
        futures = [None if b is None else pool.submit(_verify_boxed, g, b) for g, b in zip(golds, boxed, strict=True)]
        scores, hung = [], False
        for fut in futures:
            if fut is None:
                scores.append(0.0)
                continue
            try:
                scores.append(fut.result(timeout=None if hung else self.timeout_s))
            except cf.TimeoutError:
                hung = True
                scores.append(0.0)
            except Exception as e:  # a parse error in math-verify is a wrong answer, not a crash
                log.debug("math-verify failed: %s", e)
                scores.append(0.0)
        if hung:
            log.warning("math-verify timed out after %.1fs; restarting its pool", self.timeout_s)
            self._reset()
        return scores

    def close(self) -> None:
        self._reset()


_verifier: MathVerifier | None = None


def boxed_math(completions, prompts, completion_ids, answer, truncated=None, **_) -> list[float]:
    """The seed's reward: 0 for a truncated completion, else the last \\boxed{} against the gold."""
    global _verifier
    if _verifier is None:
        _verifier = MathVerifier()
        # Shut its pool down before the interpreter tears its modules down, or the pool's own exit hook finds them gone.
        atexit.register(_verifier.close)
    truncated = truncated or [False] * len(completions)
    boxed = [None if t else last_boxed(c) for c, t in zip(completions, truncated, strict=True)]
    return _verifier.check([str(a) for a in answer], boxed)


def reasoning_gym_score(completions, prompts, completion_ids, rg_entry, rg_dataset, **_) -> list[float]:
    """reasoning-gym's score of each completion: the answer its `extract_answer` reads between the answer tags (the
    prompt's opening tag put back in front), scored by the dataset that made the entry (`score_answer(answer,
    entry)`; no closed tag is no answer, scored as the dataset scores None). A `score_answer` that raises, or
    returns no number, scores its sample 0 and is logged once per batch and dataset."""
    from reasoning_gym.utils import extract_answer

    scores, failed, last_error = [], Counter(), {}
    for completion, entry, dataset in zip(completions, rg_entry, rg_dataset, strict=True):
        answer = extract_answer(ANSWER_OPEN + completion)
        try:
            scores.append(float(dataset.score_answer(answer, entry)))
        except Exception as e:  # the library's scorer, or a user's dataset registered with it: never the run's end
            metadata = entry.get("metadata") if isinstance(entry, dict) else None
            source = (metadata.get("source_dataset") if isinstance(metadata, dict) else None) or type(dataset).__name__
            failed[source] += 1
            last_error[source] = e
            scores.append(0.0)
    for source, n in failed.items():
        e = last_error[source]
        log.warning("reasoning_gym %s: score_answer raised %s: %s; %d samples scored 0", source, type(e).__name__, e, n)
    return scores


REGISTRY: dict[str, RewardFunc] = {
    "exact_answer": exact_answer,
    "boxed_math": boxed_math,
    "reasoning_gym": reasoning_gym_score,
}


def reward_columns(problems, truncated: list[bool]) -> dict[str, list]:
    """The keyword columns reward functions get beside the completions, one entry per completion of `problems` (a
    problem once per completion of it): the gold answer, whether the completion was cut by its length, and the
    problem's own columns."""
    columns = {"answer": [p.answer for p in problems], "truncated": list(truncated)}
    return columns | {key: [p.columns[key] for p in problems] for key in problems[0].columns}


def resolve_reward(name: str) -> RewardFunc:
    """A registered name, or `package.module:function` for a user's own reward."""
    return resolve_named(name, REGISTRY, "reward function", "module:function")


def _name(func: RewardFunc) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _no_log_extra(column: str, values: list) -> None:
    """TRL's `log_extra` adds columns to its completions table; spotrl keeps no such table, so it is a no-op."""


def trainer_state(step: int, max_steps: int):
    """What TRL's reward functions read as `trainer_state` (transformers' `TrainerState`): the step the group was
    sampled at (its policy version: one version per step) and the run's `train.max_steps`, for rewards shaped by
    progress."""
    with _TRANSFORMERS_IMPORT:  # transformers' lazy module: first imports racing in threads fail in all but one
        from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps)


def _invoke(func: RewardFunc, kwargs: dict[str, Any]):
    """One call, in a worker thread: an async reward function (TRL allows them) runs to its end on a loop of its own."""
    out = func(**kwargs)
    if inspect.isawaitable(out):

        async def wait():
            return await out

        out = asyncio.run(wait())
    return out


@dataclass
class Scores:
    """Weighted sums per sample, each function's own scores (unweighted, as TRL logs them), and its failures in
    this call."""

    rewards: list[float]
    per_func: dict[str, list[float | None]]
    errors: Counter = field(default_factory=Counter)


class RewardScorer:
    """Calls every reward function, sums them by weight and survives any of them failing."""

    def __init__(
        self,
        funcs: list[RewardFunc],
        timeout_s: float = 10.0,
        max_steps: int = 0,
        workers: int = 2,
        weights: list[float] | None = None,
    ):
        """`workers`: calls that may run at once (at least one per function), more where they mostly wait (a
        judge's requests); `weights`: one per function, in their order (None: 1.0 each)."""
        if not funcs:
            raise ValueError("at least one reward function is needed")
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions: one each")
        self.funcs, self.timeout_s, self.max_steps = funcs, timeout_s, max_steps
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(funcs)
        self._calls = TimedCalls(max(workers, len(funcs)), timeout_s, "reward")
        self.errors_total: Counter = Counter()
        self._logged: dict[str, list[float]] = {}  # `log_metric`'s values since the metrics were last read
        self._lock = threading.Lock()  # scores run in worker threads, the metrics are read on the event loop

    @classmethod
    def from_names(
        cls, names: list[str], timeout_s: float = 10.0, max_steps: int = 0, weights: list[float] | None = None
    ) -> RewardScorer:
        """The scorer of registered or `module:function` names, weighted as `weights` (a task's `weights()`)."""
        return cls([resolve_reward(n) for n in names], timeout_s, max_steps, weights=weights)

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: a scalar a reward function reports, averaged over a step (`reward/logged/<name>`)."""
        with self._lock:
            self._logged.setdefault(name, []).append(float(value))

    def _call(self, func: RewardFunc, n: int, kwargs: dict[str, Any]) -> list[float | None] | None:
        name = _name(func)
        try:
            out = self._calls.call(lambda: _invoke(func, kwargs))
        except TimeoutError as e:
            log.warning("reward %s: %s; its %d samples get None", name, e, n)
            return None
        except Exception as e:
            log.warning("reward %s raised %s: %s; its %d samples get None", name, type(e).__name__, e, n)
            return None
        if out is None or len(out) != n:
            log.warning(
                "reward %s returned %s values for %d samples; its samples get None",
                name,
                "no" if out is None else len(out),
                n,
            )
            return None
        return [None if v is None else float(v) for v in out]

    def score(
        self, completions: list, prompts: list, completion_ids: list[list[int]], columns: dict[str, list], step: int = 0
    ) -> Scores:
        """Every function called as TRL's `_calculate_rewards` calls it, by keyword: the samples, the `columns`
        (the dataset's, one entry per sample, and `environments` where there are some), `trainer_state` at `step`,
        and TRL's `log_extra` / `log_metric` hooks."""
        n = len(completions)
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **{k: v for k, v in columns.items() if k not in ("prompt", "completion", "completion_ids")},
            "trainer_state": trainer_state(step, self.max_steps),
            "log_extra": _no_log_extra,
            "log_metric": self._log_metric,
        }
        per_func, weighted, errors = {}, [], Counter()
        for func, weight in zip(self.funcs, self.weights, strict=True):
            values = self._call(func, n, kwargs)
            if values is None:
                errors[_name(func)] += n
                values = [None] * n
            per_func[_name(func)] = values
            weighted.append((weight, values))
        # As TRL: a None contributes nothing to the weighted sum (nansum), so one broken function never zeroes the rest.
        rewards = [sum(w * v[i] for w, v in weighted if v[i] is not None) for i in range(n)]
        self.errors_total.update(errors)
        return Scores(rewards, per_func, errors)

    def metrics(self) -> dict[str, float]:
        """Failures so far by function (`reward/errors/<name>`, and their total), the mean of what reward
        functions logged with `log_metric` since the last read, and the counters a reward function keeps of itself
        (a judge's, `app.rollout.judges`: one with a `metrics()` method), a key several keep summed."""
        with self._lock:
            logged, self._logged = self._logged, {}
        out = {f"reward/errors/{name}": float(c) for name, c in self.errors_total.items()}
        out["reward/errors_total"] = float(sum(self.errors_total.values()))
        own: Counter = Counter()
        for func in self.funcs:
            if isinstance(func, CountsItself):
                own.update(func.metrics())
        return out | {f"reward/logged/{name}": sum(v) / len(v) for name, v in logged.items()} | dict(own)

    def close(self) -> None:
        """Take no more calls (one hung in a reward function is abandoned, never waited for), and release what a
        reward function holds (a judge's client: one with a `close()`)."""
        self._calls.close()
        for func in self.funcs:
            release = getattr(func, "close", None) if not inspect.isfunction(func) else None
            if callable(release):
                release()
