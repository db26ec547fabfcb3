"""Each judge a run uses, asked once at start: a judge that cannot serve the run ends it in one line before it trains.

A judge's refusal (a 403 for another run's adapter, a 404 for a model the fleet does not serve) or a server that does
not answer would otherwise only show as every group scoring its fallback. The probe asks through the client the rollout
will use (`app.rollout.judges.JudgeReward`: the run's token on its fleet, or the judge's `url`), and names a fleet
deployment the run's judge expects but the fleet lacks, with the deployments it has.
"""

from __future__ import annotations

import httpx

from app.fleet_client import FleetError
from app.rollout.judges import JudgeReward, judge_rewards, used_judges
from contracts.adapters import split_run
from core.config.judges import LogprobVerdict


class JudgeRefused(SystemExit):
    """A judge that cannot serve the run, found at start: one line naming it and why."""


# How long the start-up probe waits for a judge's answer: vLLM compiles on its first requests for a model new to the
# machine (a fresh clone's `make train CONFIG=configs/tiny-judge.yaml` waited over 15 s on the CPU, four times a
# judge's default timeout_s, and failed at start).
PROBE_TIMEOUT_S = 120.0


def probe_judges(
    cfg, fleet_url: str, token: str | None, model_path: str, transport: httpx.BaseTransport | None = None
) -> None:
    """At start: each judge the run rewards or measures with answers once through the client the rollout will use (the
    run's token on its fleet), or JudgeRefused names it and why (a 403 for another run's adapter, a 404 for a model that
    is not served)."""
    # Each judge's own timeout is for a group's request in training; the probe checks who may ask, not how fast, and
    # a fleet just started may take long over its first answers (`PROBE_TIMEOUT_S`).
    judges = {
        name: judge.model_copy(update={"timeout_s": max(judge.timeout_s, PROBE_TIMEOUT_S)})
        for name, judge in used_judges(cfg).items()
    }
    tokenizer = None
    if any(isinstance(judge.verdict, LogprobVerdict) for judge in judges.values()):
        from core.models import load_tokenizer

        tokenizer = load_tokenizer(model_path)
    for name, judge in judge_rewards(cfg, fleet_url, token, tokenizer, transport, judges).items():
        try:
            judge.probe()
        except (FleetError, StopIteration) as e:
            raise JudgeRefused(refusal(name, judge, fleet_url, e)) from None
        finally:
            judge.close()


def refusal(name: str, judge: JudgeReward, fleet_url: str, error: BaseException) -> str:
    """Why judge `name` does not judge, in one line: what its probe raised; and for a name on the run's fleet that is
    no run's adapter (`<run>/...`) and that the fleet does not list, that the fleet has no deployment of that name,
    which deployments it has, and how a fleet gets one (its config's `judge:`)."""
    model, url = judge.judge.model, judge.judge.url
    said = f"judges.{name}: {model} at {url or fleet_url} does not judge: {error}"
    if url is not None or model == "base" or split_run(model)[0] is not None:
        return said
    try:
        listed = judge.client.models()
    except FleetError:
        return said
    if any(m.get("id") == model for m in listed):
        return said
    deployments = [m["id"] for m in listed[1:] if m.get("parent") is None]  # the base model first, then those
    return (
        f"judges.{name}: the fleet at {fleet_url} has no deployment {model!r} (its deployments: "
        f"{', '.join(deployments) or 'none'}) nor an adapter of that name this run may use; a judge model of the "
        f"fleet's own is served by its config's judge deployment, `judge: {{name: {model}, model: {{...}}}}` ({error})"
    )
