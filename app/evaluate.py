"""Held-out accuracy through the fleet: greedy completions (or, with an environment, greedy episodes) of the
held-out split, sampled and scored by the run's sampler (`app.rollout.sampling`), as the rollout scores them.

The driver calls `evaluate()` before and after training; as a command, `spotrl eval --url URL [policy-vN]`
(`launch.evaluate`, which builds the tiny model first where it is the run's) evaluates against a fleet that is
already running (`make serve` or a run in progress): the newest version in the bucket (`default_model`), or the base
model (under the name the fleet serves it) when none is published yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Mapping

from app.fleet_client import FleetClient
from app.kinds.registry import problems_of, sampler_for
from app.rollout.judges import JudgeReward, judge_agreement, judge_rewards
from app.rollout.sampling import Sampler, SamplingArgs
from app.tasks.problems import Problem
from contracts.rollouts import Sample
from core.models import prompt_token_ids

log = logging.getLogger(__name__)


async def evaluate_async(
    sampler: Sampler,
    tokenizer,
    problems: list[Problem],
    model: str,
    max_tokens: int,
    concurrency: int = 32,
    judges: Mapping[str, JudgeReward] | None = None,
) -> dict:
    """Accuracy = share of problems whose greedy sample succeeds: a positive reward, or an episode that the
    environment says is solved (else a positive reward). An episode the environment lost (its group of one failed,
    or the environment ended it) scores as unsolved and is counted in `lost`, as a lost episode costs the training
    that episode and never the run; only when every problem was lost is there no measure: EvaluationLost. With
    `judges` (a judged run measured otherwise), each one's agreement with that measure on the samples played."""
    gate = asyncio.Semaphore(concurrency)
    greedy = SamplingArgs(max_tokens, temperature=0.0)
    causes: list[str] = []

    async def one(problem: Problem) -> Sample | None:
        prompt_ids = prompt_token_ids(tokenizer, problem.prompt)
        async with gate:
            try:
                (sample,) = (await sampler.sample(problem, prompt_ids, model, 1, greedy)).samples
            except Exception as e:  # the group of one failed: the episode is lost, the evaluation goes on
                causes.append(f"{type(e).__name__}: {e}".splitlines()[0])
                return None
        return sample

    samples = await asyncio.gather(*(one(p) for p in problems))
    played = [s for s in samples if s is not None]
    lost = len(samples) - len(played) + sum(s.env_error for s in played)
    if not played:
        raise EvaluationLost(f"every one of the {len(problems)} held-out episodes was lost, the last with {causes[-1]}")
    solved = [s is not None and s.succeeded and not s.env_error for s in samples]
    by_dataset: dict[str, list[bool]] = {}
    for problem, ok in zip(problems, solved, strict=True):
        by_dataset.setdefault(source_dataset(problem), []).append(ok)
    out = {
        "model": model,
        "accuracy": sum(solved) / len(samples),
        # A mix of datasets: each one's own accuracy, which the mix's one number hides.
        **(
            {"accuracy_by_dataset": {name: sum(oks) / len(oks) for name, oks in sorted(by_dataset.items())}}
            if len(by_dataset) > 1
            else {}
        ),
        "mean_reward": sum(0.0 if math.isnan(s.reward) else s.reward for s in played) / len(samples),
        "turns_mean": sum(s.num_turns for s in played) / len(played),
        "num_problems": len(problems),
        "lost": lost,
    }
    if judges:
        out["judge_agreement"] = await asyncio.to_thread(agreements, judges, problems, samples, solved)
    return out


def agreements(
    judges: Mapping[str, JudgeReward], problems: list[Problem], samples: list[Sample | None], solved: list[bool]
) -> dict[str, float]:
    """Each judge's agreement with the evaluation's verdicts on the samples played (`app.rollout.judges`), each
    sample shown to it as in training: a completion after its problem's prompt, an episode as its messages (its
    `{transcript}` every turn); a judge that fails here is left out, logged: the accuracy stands without it."""
    kept = [
        (p, s.judged or (p.prompt, s.text), ok)
        for p, s, ok in zip(problems, samples, solved, strict=True)
        if s and not s.env_error
    ]
    found: dict[str, float] = {}
    if not kept:
        return found
    played, seen, verdicts = (list(column) for column in zip(*kept, strict=True))
    for name, judge in judges.items():
        try:
            found[name] = judge_agreement(judge, played, seen, verdicts)
        except Exception as e:  # noqa: BLE001 - the measure of trust in a judge never costs the evaluation
            log.warning("judge %s: no agreement measured: %s: %s", name, type(e).__name__, e)
    return found


def source_dataset(problem: Problem) -> str:
    """The dataset of a mix that made `problem` (reasoning-gym's `source_dataset`), or "" for a task of one."""
    entry = problem.columns.get("rg_entry")
    metadata = entry.get("metadata") if isinstance(entry, dict) else None
    return str(metadata.get("source_dataset") or "") if isinstance(metadata, dict) else ""


class EvaluationLost(RuntimeError):
    """Every held-out episode was lost: the environment fails on every problem, and there is nothing to measure."""


def evaluate(
    cfg,
    base_url: str,
    model_path: str,
    model: str,
    token: str | None = None,
    context: str | None = None,
    judged: bool = False,
) -> dict:
    """Evaluate `model` (the base name or `policy-vN`) on the config's held-out split, each problem under the
    privileged prompt `context` renders where one is given (a self teacher); its client and sampler are closed when
    done (the driver evaluates twice a run, a long-lived caller many times). Its samples are scored by
    `eval.reward_funcs` where the run names them (a run rewarded by a judge measured by the exact answer); then, with
    `judged` (the run's own versions on its own fleet), each judge it rewards with says how often it agrees."""
    from app.tasks.privileged import privileged_problem
    from core.config.evaluation import scored_as_evaluated
    from core.models import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    measured_otherwise = judged and cfg.eval.reward_funcs is not None
    judges = judge_rewards(cfg, base_url, token, tokenizer) if measured_otherwise else {}
    cfg = scored_as_evaluated(cfg)
    problems = problems_of(cfg).heldout
    if context is not None:
        problems = [privileged_problem(context, p) for p in problems]
    with contextlib.ExitStack() as stack, contextlib.closing(FleetClient(base_url, token)) as client:
        for judge in judges.values():
            stack.callback(judge.close)
        sampler = sampler_for(
            cfg, tokenizer, client.acompletions, fleet_url=base_url, token=token, model_path=model_path
        )

        async def run() -> dict:
            try:
                return await evaluate_async(
                    sampler,
                    tokenizer,
                    problems,
                    model,
                    cfg.sampling.max_completion_length,
                    cfg.task.eval_concurrency,
                    judges,
                )
            finally:
                await client.aclose()  # on the loop its connections belong to

        try:
            return asyncio.run(run())
        finally:
            sampler.close()


def base_model_name(fleet: FleetClient) -> str:
    """The name the fleet serves the base model under: the one model of `/v1/models` without a parent."""
    return next(m["id"] for m in fleet.models() if m.get("parent") is None)


def default_model(cfg, fleet: FleetClient) -> str:
    """What to evaluate when no adapter is named: the newest version in the bucket, else the base model."""
    from contracts.adapters import adapter_name
    from core.bucket.store import AdapterStore

    latest = AdapterStore.from_config(cfg).latest()
    return adapter_name(latest, cfg.fleet_run) if latest is not None else base_model_name(fleet)
