"""Coalescing: concurrent requests of one run that the engine would serve alike become one replica call.

Most clients ask for one sample, or score one sequence, per request (TRL's AsyncGRPOTrainer, the Tinker cookbook's RL
loops and KL penalty, verifiers, a distillation teacher): a group of G samples arrives as G requests of `n=1`, its G
scored sequences as G requests, within milliseconds. Each would otherwise make its own trip through the fair share,
the router, the Serve handle, the replica and the engine, which on a small machine costs far more than the sampling
(bench/request_shapes.py measures it). Two ways to share a trip, among the requests of one run that arrive less than
`window_s` apart (a call waits `window_s` after its latest request, and at most `MAX_WINDOWS` windows after its first:
the requests of a group, parsed one after another by a busy ingress, reach it a millisecond or two apart each):

- *merged*: requests that ask for the same thing (prompt ids, model, sampling but `n`, turn and session) are one
  `GenerateRequest` of their summed `n`, and the choices are dealt back in order, each caller's renumbered from 0. A
  choice is the engine's sample for that caller alone, its tokens and log-probs as sampled: vLLM samples the `n`
  children of a request independently. Never merged: requests with a seed (vLLM seeds a group's children `seed + i`,
  so a seeded request's tokens would change) and greedy ones (vLLM samples them one by one).
- *bundled*: scored sequences (`prompt_logprobs`, at most one token sampled) that share their routing (model, session,
  turn and first KV block: a group's sequences share their prompt) go side by side in one replica call
  (`contracts.serving.GenerateBundle`), each still an engine request of its own, answered apart. Only scoring: its
  engine time is one prefill, so no answer waits for a longer one, and the sequences would have been routed to the
  replica holding their prompt anyway. Generations of distinct prompts are never bundled: a shared system prompt
  would tie a run's whole load to one replica, and each answer to the slowest.

Which requests may share a call, and how one answer is dealt back, is a `Kind`: the fleet's generations here
(`Generations`), the Tinker service's completion bodies on their way to the fleet
(`deployments.tinker.merging`).

What stays as it was: each call goes through the same gate (its run's places, one per sequence), the same
prefix-hash routing and the same hand-back (`ServeBackend` stitches before the choices are dealt). Runs never share
a call (each run's fair share). A caller that goes away leaves its samples unread; a call is cancelled only once
every caller of it has gone, and a caller gone before its call was sent is left out of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from contracts.serving import Generated, GenerateRequest

R = TypeVar("R")  # a request
A = TypeVar("A")  # its answer
C = TypeVar("C")  # one choice of an answer

# vLLM's `_SAMPLING_EPS`: a temperature below it samples greedily, one sample per request.
GREEDY_BELOW = 1e-5
# The longest a call waits for more requests, in windows after its first one: a steady stream of like requests
# less than a window apart still goes out.
MAX_WINDOWS = 4


@dataclass(frozen=True)
class Merged(Generic[R]):
    """Like requests as one engine request of their summed `n`, and how many clients' requests it answers (what
    their run's usage counts)."""

    request: R
    callers: int = 1


# One call: like requests as one each (`Merged`), the answer or failure of each in order.
Send = Callable[[list[Merged[R]]], Awaitable[list[A | Exception]]]


class Kind(Protocol[R, A]):
    """Which requests of a tenant may share a call, and how they become one and their answer theirs again."""

    def call_key(self, tenant: str, request: R) -> tuple | None:
        """The call this request may join (None: it goes alone)."""

    def part_key(self, tenant: str, request: R) -> object:
        """Requests of one call with the same part key are merged into one request of their summed `n`."""

    def n(self, request: R) -> int: ...

    def merged(self, first: R, n: int) -> R: ...

    def deal(self, answer: A, counts: list[int]) -> list[A]:
        """The merged answer split among its callers in order, each caller's `counts[i]` renumbered from 0."""


def coalescable(request: GenerateRequest) -> bool:
    """Whether samples of this request may share an engine request with others': not a seeded one (its tokens depend
    on its seed), nor a greedy one (vLLM refuses `n` > 1 below its `_SAMPLING_EPS`, the ingress's
    GREEDY_TEMPERATURE)."""
    return request.sampling.seed is None and request.sampling.temperature >= GREEDY_BELOW


def scoring(request: GenerateRequest) -> bool:
    """A scored sequence: its prompt's log-probs asked for, at most one token sampled (one prefill of engine time)."""
    sampling = request.sampling
    return sampling.prompt_logprobs is not None and sampling.max_tokens is not None and sampling.max_tokens <= 1


def merge_key(tenant: str, request: GenerateRequest) -> tuple:
    """What requests must share to be merged: the run, the prompt, the model, everything sampled but `n`."""
    same_sampling = dataclasses.replace(request.sampling, n=1)
    return (tenant, request.model, tuple(request.prompt_ids), request.turn, request.session, repr(same_sampling))


def bundle_key(tenant: str, request: GenerateRequest, block_size: int) -> tuple:
    """What scored sequences must share to be bundled: the run, and what routes them (model, session, first block).
    A sequence shorter than one block has no block to route by (the router hashes full blocks only, as vLLM caches
    them): it goes to the least loaded replica, as any other such sequence of its run would, so they share a call."""
    ids = request.prompt_ids
    first_block = tuple(ids[:block_size]) if len(ids) >= block_size else ()
    return ("bundle", tenant, request.model, request.turn, request.session, first_block)


def merged(first: GenerateRequest, n: int) -> GenerateRequest:
    return dataclasses.replace(first, sampling=dataclasses.replace(first.sampling, n=n))


def shares(choices: list[C], counts: list[int]) -> list[list[C]]:
    """A merged answer's choices (in index order) split among its callers in order: caller i gets the next
    `counts[i]`. A short answer (a replica that answers fewer choices than asked) deals what there is."""
    out, start = [], 0
    for count in counts:
        out.append(choices[start : start + count])
        start += count
    return out


def deal(result: Generated, counts: list[int]) -> list[Generated]:
    """The merged answer split among its callers (`shares`), each caller's choices numbered from 0."""
    mine = shares(sorted(result.choices, key=lambda c: c.index), counts)
    return [
        Generated(result.replica, [dataclasses.replace(c, index=i) for i, c in enumerate(share)], result.handed_back)
        for share in mine
    ]


class Generations:
    """The fleet's kind (`Kind`): generations merged by `merge_key`, scored sequences bundled by `bundle_key`."""

    def __init__(self, block_size: int = 32):
        self.block_size = block_size  # the router's (`fleet.router.block_size`): a bundle shares its first block

    def call_key(self, tenant: str, request: GenerateRequest) -> tuple | None:
        if scoring(request):
            return bundle_key(tenant, request, self.block_size)
        return merge_key(tenant, request) if coalescable(request) else None

    def part_key(self, tenant: str, request: GenerateRequest) -> object:
        return merge_key(tenant, request) if coalescable(request) else object()  # seeded, greedy: never merged

    def n(self, request: GenerateRequest) -> int:
        return request.sampling.n

    def merged(self, first: GenerateRequest, n: int) -> GenerateRequest:
        return merged(first, n)

    def deal(self, answer: Generated, counts: list[int]) -> list[Generated]:
        return deal(answer, counts)


@dataclass
class _Part(Generic[R]):
    """Requests merged into one engine request (or one alone): each caller's `n` and where its answer goes."""

    first: R
    counts: list[int] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)

    def live(self) -> _Part[R] | None:
        """This part without the callers gone meanwhile; None when none is left."""
        kept = [(n, f) for n, f in zip(self.counts, self.futures, strict=True) if not f.cancelled()]
        return _Part(self.first, [n for n, _ in kept], [f for _, f in kept]) if kept else None

    def answer(self, answer: object, deal_out: Callable[[object, list[int]], list]) -> None:
        if isinstance(answer, BaseException):  # every caller gets the failure (a 4xx stays a 4xx)
            shares = [answer] * len(self.futures)
        else:
            shares = deal_out(answer, self.counts)
        for future, share in zip(self.futures, shares, strict=True):
            if future.done():
                continue
            if isinstance(share, BaseException):
                future.set_exception(share if isinstance(share, Exception) else asyncio.CancelledError())
            else:
                future.set_result(share)


@dataclass
class _Call:
    """One call in the making: its parts by part key."""

    opened: float  # the loop's time at its first request
    parts: dict[object, _Part] = field(default_factory=dict)
    n: int = 0
    task: asyncio.Task | None = None
    latest: float = 0.0  # the loop's time at its latest request

    def futures(self) -> list[asyncio.Future]:
        return [f for part in self.parts.values() for f in part.futures]


class Coalescer(Generic[R, A]):
    """Merges concurrent like requests of one tenant (`Kind.part_key`) into one request of their summed `n`, and puts
    those that may share a call (`Kind.call_key`) into one, up to `max_n` sequences per call; `window_s` 0 sends every
    request alone. The fleet's generations (`Generations`) unless another `kind` is given."""

    def __init__(self, window_s: float, max_n: int = 256, kind: Kind[R, A] | None = None):
        # How long a call waits for another request after its latest (`fleet.coalesce_window_s`): well under one
        # engine step on a CPU, and the samples of one group, sent back to back, reach the ingress closer than that.
        self.window_s = window_s
        self.max_n = max_n
        self.kind: Kind = kind if kind is not None else Generations()
        self._open: dict[tuple, _Call] = {}
        self.requests = 0  # requests asked for
        self.calls = 0  # calls made for them

    async def generate(self, tenant: str, request: R, send: Send[R, A]) -> A:
        self.requests += 1
        kind, n = self.kind, self.kind.n(request)
        key = kind.call_key(tenant, request)
        if self.window_s <= 0 or key is None or n >= self.max_n:
            self.calls += 1
            [answer] = await send([Merged(request)])
            if isinstance(answer, Exception):
                raise answer
            return answer
        loop = asyncio.get_running_loop()
        call = self._open.get(key)
        if call is None or call.n + n > self.max_n:
            if call is not None:  # full: it goes now, this request opens the next one
                self._flush(key, call, send)
            call = self._open[key] = _Call(opened=loop.time())
            loop.call_later(self.window_s, self._due, key, call, send)
        call.latest = loop.time()
        part = call.parts.setdefault(kind.part_key(tenant, request), _Part(request))
        future = loop.create_future()
        part.counts.append(n)
        part.futures.append(future)
        call.n += n
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.cancel()
            if call.task is not None and all(f.cancelled() for f in call.futures()):
                call.task.cancel()  # nobody waits for its samples any more
            raise

    def _due(self, key: tuple, call: _Call, send: Send[R, A]) -> None:
        """A call's window has passed since its latest request: it goes, unless one came within the window and the
        call has waited less than `MAX_WINDOWS` (then it waits for the window after that one)."""
        loop = asyncio.get_running_loop()
        goes_by = call.opened + MAX_WINDOWS * self.window_s
        wait = min(call.latest + self.window_s, goes_by) - loop.time()
        if call.task is None and wait > 0:
            loop.call_later(wait, self._due, key, call, send)
        else:
            self._flush(key, call, send)

    def _flush(self, key: tuple, call: _Call, send: Send[R, A]) -> None:
        if call.task is not None:
            return  # sent already (it filled up before its window ended)
        if self._open.get(key) is call:
            del self._open[key]
        parts = [live for part in call.parts.values() if (live := part.live()) is not None]
        if not parts:
            return
        call.parts = dict(enumerate(parts))  # callers gone: no samples for them
        self.calls += 1
        call.task = asyncio.get_running_loop().create_task(self._send(parts, send))

    async def _send(self, parts: list[_Part], send: Send[R, A]) -> None:
        try:
            answers = await send([Merged(self.kind.merged(p.first, sum(p.counts)), len(p.counts)) for p in parts])
        except BaseException as e:  # every caller gets the failure, cancellation included
            for part in parts:
                part.answer(e, self.kind.deal)
            if not isinstance(e, Exception):
                raise
            return
        for part, answer in zip(parts, answers, strict=True):
            part.answer(answer, self.kind.deal)
