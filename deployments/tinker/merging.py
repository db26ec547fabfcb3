"""Like sample requests of one key as one fleet call: the cookbook's RL loops ask for a group of G samples as G
requests of one sample, sent back to back.

Each would otherwise be its own call to the fleet: through the fleet's door, its auth, fair share and router, and an
engine request of its own, since the requests reach the fleet spread out by this service's own work on each, wider
than the fleet's coalescing window. So the service merges them before they leave, with the fleet's own `Coalescer`:
completion bodies of one key that differ in `n` alone, arriving within `tinker.sample_merge_window_s` of the first,
are one call of their summed `n` (at most the fleet's sequences per request), and its choices are dealt back in
order, each caller's renumbered from 0. A choice is still the engine's own sample for that caller: vLLM samples the
`n` children of a request independently. Never merged, as in the fleet: seeded requests (vLLM seeds a request's
children `seed + i`) and greedy ones.
"""

from __future__ import annotations

import json
from typing import Any

from deployments.control.coalesce import GREEDY_BELOW, shares

Body = dict[str, Any]  # a completions request of the fleet's API (vLLM's fields), and its answer
ONE_PART = "alike"  # every body of a call is one merged request


class CompletionBodies:
    """The Tinker service's `deployments.control.coalesce.Kind`: fleet completion bodies that differ in `n` alone."""

    def call_key(self, tenant: str, body: Body) -> tuple | None:
        temperature = body.get("temperature")
        if body.get("seed") is not None or (temperature is not None and temperature < GREEDY_BELOW):
            return None
        return (tenant, json.dumps({k: v for k, v in body.items() if k != "n"}, sort_keys=True))

    def part_key(self, tenant: str, body: Body) -> object:
        return ONE_PART  # the call key says all: a call's bodies are alike (and the fleet's API takes one `n`)

    def n(self, body: Body) -> int:
        return int(body.get("n") or 1)

    def merged(self, first: Body, n: int) -> Body:
        return {**first, "n": n}

    def deal(self, answer: Body, counts: list[int]) -> list[Body]:
        mine = shares(sorted(answer["choices"], key=lambda c: c["index"]), counts)
        return [{**answer, "choices": [{**c, "index": i} for i, c in enumerate(share)]} for share in mine]
