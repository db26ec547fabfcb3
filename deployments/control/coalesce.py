"""Coalescing: concurrent generations of one prompt under one adapter, sampled alike, become one engine call with `n`.

Most clients ask for one sample per request (TRL's AsyncGRPOTrainer, the Tinker cookbook's RL loops, verifiers): a
group of G samples arrives as G requests of `n=1` within milliseconds. Each would otherwise make its own trip
through the fair share, the router, the Serve handle, the replica and the engine, which on a small machine costs far
more than the sampling (bench/request_shapes.py measures it). Here the generations of one run that ask for the same
thing (prompt ids, model, sampling but `n`, turn and session) within `window_s` of the first are sent as one
`GenerateRequest` of their summed `n`, and the choices are dealt back in order, each caller's renumbered from 0.

What stays as it was: the merged request goes through the same gate (its run's places, one per sequence), the same
prefix-hash routing (same prompt, same adapter) and the same hand-back (`ServeBackend.generate` stitches before the
choices are dealt). A choice is the engine's sample for that caller alone, its tokens and log-probs as sampled:
vLLM samples the `n` children of a request independently. Never merged: requests with a seed (vLLM seeds a group's
children `seed + i`, so a seeded request's tokens would change), greedy ones (vLLM samples them one by one) and runs
apart (each run's fair share). A caller that goes away leaves its samples unread; the engine call is cancelled only
once every caller of it has gone, and a caller gone before its call was sent is left out of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from contracts.serving import Generated, GenerateRequest

# vLLM's `_SAMPLING_EPS`: a temperature below it samples greedily, one sample per request.
GREEDY_BELOW = 1e-5

# One engine call: the request, and how many clients' requests it serves (what their run's usage counts).
Send = Callable[[GenerateRequest, int], Awaitable[Generated]]


def coalescable(request: GenerateRequest) -> bool:
    """Whether samples of this request may share an engine call with others': not a seeded one (its tokens depend on
    its seed), nor a greedy one (vLLM refuses `n` > 1 below its `_SAMPLING_EPS`, the ingress's GREEDY_TEMPERATURE)."""
    return request.sampling.seed is None and request.sampling.temperature >= GREEDY_BELOW


def merge_key(tenant: str, request: GenerateRequest) -> tuple:
    """What requests must share to be merged: the run, the prompt, the model, everything sampled but `n`."""
    same_sampling = dataclasses.replace(request.sampling, n=1)
    return (tenant, request.model, tuple(request.prompt_ids), request.turn, request.session, repr(same_sampling))


def merged(first: GenerateRequest, n: int) -> GenerateRequest:
    return dataclasses.replace(first, sampling=dataclasses.replace(first.sampling, n=n))


def deal(result: Generated, counts: list[int]) -> list[Generated]:
    """The merged answer split among its callers in order: caller i gets the next `counts[i]` choices, numbered
    from 0. A short answer (a replica that answers fewer choices than asked) deals what there is."""
    choices = sorted(result.choices, key=lambda c: c.index)
    out, start = [], 0
    for count in counts:
        mine = [dataclasses.replace(c, index=i) for i, c in enumerate(choices[start : start + count])]
        out.append(Generated(result.replica, mine, result.handed_back))
        start += count
    return out


@dataclass
class _Batch:
    first: GenerateRequest
    counts: list[int] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    task: asyncio.Task | None = None

    @property
    def n(self) -> int:
        return sum(self.counts)


class Coalescer:
    """Merges concurrent like generations of one run (`merge_key`) into one `send` of their summed `n`, up to
    `max_n` sequences per call; `window_s` 0 sends every request alone."""

    def __init__(self, window_s: float, max_n: int = 256):
        # How long the first request of a kind waits for others (`fleet.coalesce_window_s`): well under one engine
        # step on a CPU, and the samples of one group, sent back to back, reach the ingress within it.
        self.window_s = window_s
        self.max_n = max_n
        self._open: dict[tuple, _Batch] = {}
        self.requests = 0  # generations asked for
        self.calls = 0  # sends made for them

    async def generate(self, tenant: str, request: GenerateRequest, send: Send) -> Generated:
        self.requests += 1
        if self.window_s <= 0 or not coalescable(request) or request.sampling.n >= self.max_n:
            self.calls += 1
            return await send(request, 1)
        key = merge_key(tenant, request)
        batch = self._open.get(key)
        if batch is None or batch.n + request.sampling.n > self.max_n:
            if batch is not None:  # full: it goes now, this request opens the next one
                self._flush(key, batch, send)
            batch = self._open[key] = _Batch(request)
            asyncio.get_running_loop().call_later(self.window_s, self._flush, key, batch, send)
        future = asyncio.get_running_loop().create_future()
        batch.counts.append(request.sampling.n)
        batch.futures.append(future)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.cancel()
            if batch.task is not None and all(f.cancelled() for f in batch.futures):
                batch.task.cancel()  # nobody waits for its samples any more
            raise

    def _flush(self, key: tuple, batch: _Batch, send: Send) -> None:
        if batch.task is not None:
            return  # sent already (it filled up before its window ended)
        if self._open.get(key) is batch:
            del self._open[key]
        live = [(n, f) for n, f in zip(batch.counts, batch.futures, strict=True) if not f.cancelled()]
        if not live:
            return
        batch.counts, batch.futures = [n for n, _ in live], [f for _, f in live]  # callers gone: no samples for them
        self.calls += 1
        batch.task = asyncio.get_running_loop().create_task(self._send(batch, send))

    async def _send(self, batch: _Batch, send: Send) -> None:
        try:
            result = await send(merged(batch.first, batch.n), len(batch.counts))
        except BaseException as e:  # every caller gets the failure (a 4xx stays a 4xx), cancellation included
            for future in batch.futures:
                if not future.done():
                    future.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            if not isinstance(e, Exception):
                raise
            return
        for future, share in zip(batch.futures, deal(result, batch.counts), strict=True):
            if not future.done():
                future.set_result(share)
