"""Cutting a run's generations in flight under older versions, on every replica: partial rollouts' half of the fleet.

A run whose learner published a newer version cuts what it still generates under older ones
(`POST /v1/cut`, `app.rollout.continuation`): each live replica aborts its requests under those adapters in vLLM
(`contracts.control.CutGenerations`), and each answers its caller at once, finish reason `abort`, with the
tokens it had and their log-probs, which the run continues under the newest version. Only the named adapters
are touched (a run's token names its own alone, `deployments.api.callers`): on a shared fleet one run's cut
pauses nobody else's generations.

Unlike a load, a cut is not all or nothing, and cannot be undone: a replica that fails to cut lets those
generations finish under their version, which costs the run time, not correctness (every token carries the
version that sampled it). So the reply counts what was cut and the replicas that failed, and raises only when
no replica answered.
"""

from __future__ import annotations

import logging
from typing import Any

from contracts.control import CutGenerations
from deployments.control.backend import Backend
from deployments.control.errors import ApiError

log = logging.getLogger("ray.serve")


async def cut_everywhere(backend: Backend, models: list[str]) -> dict[str, Any]:
    """Cut the generations under `models` on every live replica: how many, on how many replicas, and failures."""
    results = await backend.broadcast(CutGenerations(tuple(models)))
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        log.warning("cutting %s failed on a replica: %r", ", ".join(models), failure)
    if not results:
        raise ApiError(503, "no live replica")
    if len(failures) == len(results):
        raise ApiError(502, f"cutting failed on all {len(results)} replicas: {type(failures[0]).__name__}")
    return {
        "status": "ok",
        "models": list(models),
        "replicas": len(results) - len(failures),
        "failed": len(failures),
        "cut": sum(r.requests for r in results if not isinstance(r, BaseException)),
    }
