"""Generations that outlive a weight update: a cut choice is continued under a newer version, token-exact.

With partial rollouts on (`rollout.partial_rollouts`), when the learner publishes a newer version the rollout
cuts its generations still in flight under older ones (`POST /v1/cut`, which each replica answers by aborting
them in vLLM): each cut request comes back at once with finish reason `abort` and the tokens it had so far,
with their log-probs. `Continuation` sends every cut choice on, under the model its group samples under now
(`Flight.model_now`: the newest versioned adapter), from the prompt plus the token ids so far, asking for the
tokens that are left: one request for all the cut choices of a request, one prompt each (one request per
distinct allowance), until each finishes; it may be cut again. The stitched choice is token-exact: its ids,
log-probs and the version that sampled each token, concatenated; its text decoded from all its ids at once,
since a cut may split a multi-byte character.

A `Flight` is one group being sampled, as the producer and its sampler share it: which model its requests
name now, whether it may go on (a sampler that takes turns asks before each later turn), and what it has
on the wire and got back, by version: what the producer cuts, and the staleness of what is still in flight.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from contracts.adapters import AdapterRef
from contracts.rollouts import Choice, Generate

CUT = "abort"  # vLLM's finish reason of an aborted request, which the fleet answers a cut request with
# A choice cut this many times in a row without a single new token is not progressing (a fleet that aborts
# everything it is sent): its group fails rather than loop.
MAX_EMPTY_CUTS = 16


def version_of(model: str) -> int | None:
    """The policy version a model name means (`policy-v3`, `alice/policy-v3`), None for any other name."""
    ref = AdapterRef.parse(model)
    return None if ref is None else ref.version


@dataclass
class Flight:
    """A group being sampled: the model its next request names, whether it may go on, what it has on the wire."""

    started: int | None  # the version its first request named (None: not a policy version)
    model_now: Callable[[], str]  # what a continuation or a later turn names: the newest version, or its own
    may_go_on: Callable[[], bool] = lambda: True  # False once it could never be trained: no later turn then
    on_wire: Counter[str] = field(default_factory=Counter)  # its requests on the wire, by model name
    newest: int | None = None  # the version its latest request named
    got: Counter[int] = field(default_factory=Counter)  # model tokens come back so far, by the version that sampled

    @classmethod
    def pinned(cls, model: str) -> Flight:
        """A flight that names `model` throughout and never stops (the evaluation's)."""
        return cls(version_of(model), lambda: model)

    @contextmanager
    def sending(self, model: str) -> Iterator[None]:
        self.on_wire[model] += 1
        self.newest = version_of(model)
        try:
            yield
        finally:
            self.on_wire[model] -= 1
            if not self.on_wire[model]:
                del self.on_wire[model]


@dataclass
class CutCounters:
    """What cuts cost the rollout so far."""

    choices: int = 0  # choices completed
    cut_choices: int = 0  # of those, cut at least once
    cuts: int = 0  # cuts in all (a choice may be cut more than once)
    prefilled_again: int = 0  # prompt and generated tokens sent again as the prompt of a continuation


def stitch(head: Choice, tail: Choice) -> Choice:
    """`head`, cut, continued by `tail`: ids, log-probs and versions end to end (text is decoded at the end)."""
    versions = None if head.versions is None or tail.versions is None else head.versions + tail.versions
    return Choice(
        head.index,
        head.token_ids + tail.token_ids,
        head.logprobs + tail.logprobs,
        head.text + tail.text,
        tail.finish_reason,
        versions,
    )


class Continuation:
    """Asks the fleet for finished choices: sends, then continues what comes back cut, stitching it token-exact.

    `decode` is the rollout's tokenizer's (`core.models.completion_text`); without one (tests), a stitched
    choice's text is its segments' texts joined."""

    def __init__(self, generate: Generate, decode: Callable[[list[int]], str] | None = None):
        self.generate, self.decode = generate, decode
        self.counters = CutCounters()

    async def complete(
        self, prompts: list[list[int]], n: int, rooms: list[int], sampling, flight: Flight, turn: int | None = None
    ) -> list[Choice]:
        """`n` finished choices per prompt, in prompt order, prompt `k`'s with at most `rooms[k]` tokens, each
        continued under `flight.model_now()` as often as it is cut. `sampling` is a `SamplingArgs`."""
        choices = await self._request(prompts, n, rooms, sampling, flight, turn)
        room = [rooms[k] for k in range(len(prompts)) for _ in range(n)]
        prompt_of = [prompts[k] for k in range(len(prompts)) for _ in range(n)]
        empty_cuts = [0] * len(choices)
        cut: set[int] = set()
        while pending := [j for j, c in enumerate(choices) if c.finish_reason == CUT and len(c.token_ids) < room[j]]:
            cut.update(pending)
            self.counters.cuts += len(pending)
            heads = [prompt_of[j] + choices[j].token_ids for j in pending]
            self.counters.prefilled_again += sum(len(h) for h in heads)
            tails = await self._request(
                heads, 1, [room[j] - len(choices[j].token_ids) for j in pending], sampling, flight, turn
            )
            for j, tail in zip(pending, tails, strict=True):
                empty_cuts[j] = empty_cuts[j] + 1 if tail.finish_reason == CUT and not tail.token_ids else 0
                if empty_cuts[j] >= MAX_EMPTY_CUTS:
                    raise RuntimeError(f"a generation was cut {MAX_EMPTY_CUTS} times in a row without a new token")
                choices[j] = stitch(choices[j], tail)
        self.counters.choices += len(choices)
        self.counters.cut_choices += len(cut)
        for j, c in enumerate(choices):
            if c.finish_reason == CUT:  # cut with no room left: it had all it could get
                c.finish_reason = "length"
            if j in cut and self.decode is not None:
                c.text = self.decode(c.token_ids)
        return choices

    async def _request(
        self, prompts: list[list[int]], n: int, rooms: list[int], sampling, flight: Flight, turn: int | None
    ) -> list[Choice]:
        """`n` choices per prompt under `flight.model_now()`, tagged with its version: one request per distinct
        allowance (as a rule one in all), a single prompt sent as one, so that `n` samples share its prefill."""
        model = flight.model_now()
        batches: dict[int, list[int]] = {}
        for k, r in enumerate(rooms):
            batches.setdefault(r, []).append(k)
        # Only a multi-turn episode's request says its turn (the router counts affinity per turn).
        extra = {} if turn is None else {"turn": turn}
        if sampling.min_p:  # vLLM's SamplingParams name, which the fleet's body takes; unset, its default (0)
            extra["min_p"] = sampling.min_p
        with flight.sending(model):
            answers = await asyncio.gather(
                *(
                    self.generate(
                        [prompts[k] for k in ks] if len(prompts) > 1 else prompts[0],
                        model,
                        n,
                        room,
                        sampling.temperature,
                        sampling.top_p,
                        sampling.top_k,
                        **extra,
                    )
                    for room, ks in batches.items()
                )
            )
        out: list[Choice | None] = [None] * (len(prompts) * n)
        for (_, ks), choices in zip(batches.items(), answers, strict=True):
            if len(choices) != len(ks) * n:
                raise ValueError(f"the fleet answered {len(choices)} choices for {len(ks)} prompts x {n}")
            for j, k in enumerate(ks):
                out[k * n : (k + 1) * n] = choices[j * n : (j + 1) * n]
        version = version_of(model)
        for c in out:
            if len(c.logprobs) != len(c.token_ids):
                raise ValueError(f"the fleet returned {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs")
            c.versions = None if version is None else [version] * len(c.token_ids)
            if version is not None:
                flight.got[version] += len(c.token_ids)
        return out
