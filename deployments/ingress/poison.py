"""Poison requests: a request during which engines die is not passed on to kill replica after replica.

The ingress sends a generation whose replica died to another replica (`deployments.ingress.shell`): right
for a preempted node, ruinous for a request that itself crashes the engine (a seed vLLM's GPU model
runner cannot take, an input that trips a kernel bug), which would go round the fleet and kill
every replica in turn. The replica says which of the two it saw: `ReplicaUnavailable` when its
engine was dead before the request came or it is shutting down (retried as before), `EngineDied`
when the engine died while serving the request.

An engine's death does not say which of its in-flight requests caused it, so a request that saw one
is sent once more: the bystanders of a crash then succeed elsewhere. A request that sees a second
death is answered 500, and its fingerprint (prompt, model, sampling) is refused for a while, so a
client that sends it again cannot kill a third replica. A bystander caught in both crashes is refused
with it: the price of letting no request kill more than two replicas.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from contracts.serving import GenerateRequest, ReplicaError

log = logging.getLogger("ray.serve")

# Engine deaths one request may see: the first may be a bystander's bad luck, the second is not sent again.
ENGINE_DEATHS_PER_REQUEST = 2
# How long a request that killed two engines is refused: long enough to outlast a client sending it again,
# short enough that a bystander refused with it (see above) is not refused for long.
POISON_TTL_S = 600.0
# Fingerprints remembered at most (about 100 bytes each): a flood of distinct poison requests evicts the
# oldest instead of growing the ingress's memory.
POISON_MAX_ENTRIES = 10_000


class PoisonRequest(ReplicaError):
    """The request killed the engines of two replicas, or is one that did: it is not sent to a replica."""

    status = 500


def fingerprint(request: GenerateRequest) -> str:
    """A request's identity for the poison table: its prompt ids, model and every sampling field (seed included).

    The dataclasses' repr lists every field, so a field added to `Sampling` is part of it without a change here.
    """
    return hashlib.blake2b(repr(request).encode(), digest_size=16).hexdigest()


class PoisonTable:
    """The fingerprints of poison requests, each refused for `ttl_s`; at most `max_entries` (oldest go first)."""

    def __init__(
        self,
        ttl_s: float = POISON_TTL_S,
        max_entries: int = POISON_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        # fingerprint -> refused until; insertion order is expiry order, since every entry lives `ttl_s`
        self._until: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._until)

    def check(self, key: str) -> None:
        """Raise PoisonRequest if `key` is refused now."""
        self._expire()
        if key in self._until:
            raise PoisonRequest(
                f"this request killed the engines of {ENGINE_DEATHS_PER_REQUEST} replicas and is refused for another "
                f"{self._until[key] - self._clock():.0f} s (request fingerprint {key}); a changed request (another "
                "seed, say) is not refused"
            )

    def engine_failure(self, key: str, engine_deaths: int) -> ReplicaError:
        """The 500 for a request whose last attempt's engine died; after two deaths it is refused from now on."""
        if engine_deaths < ENGINE_DEATHS_PER_REQUEST:  # its other attempts hit dead replicas: no second engine
            return ReplicaError("the engine died while serving it, and no other replica took it")
        self.add(key)
        log.error("request %s killed %d engines: refused for %.0f s", key, engine_deaths, self.ttl_s)
        return PoisonRequest(
            f"the engines of {engine_deaths} replicas died while serving this request; it is refused for "
            f"{self.ttl_s:.0f} s (request fingerprint {key})"
        )

    def add(self, key: str) -> None:
        self._until.pop(key, None)
        self._until[key] = self._clock() + self.ttl_s
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def _expire(self) -> None:
        now = self._clock()
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)
