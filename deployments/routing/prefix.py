"""Prefix affinity, as pure logic: chained block hashes, a bounded LRU table, and the routing decision.

vLLM caches KV in fixed-size blocks keyed by a chain of hashes (each block's hash covers every token
before it, and the chain is per adapter). If the router hashes prompts the same way, "which replica
already holds the longest run of this prompt's blocks" is a dictionary lookup per block, and the G
samples of a prompt land where the first one left its KV cache: one prefill, G-1 cache hits.

Nothing here imports Ray, so the policy is unit-tested in isolation; `deployments.routing.router` wires it
into Ray Serve's `RequestRouter`.

Rules, in the words of the design:
- only full blocks are hashed (vLLM caches only full blocks), and the chain is seeded with the
  adapter name, so a prefix cached for `policy-v3` never counts for `policy-v4`;
- a block that every live replica holds (a shared system prompt) says nothing about where to go,
  so it does not count towards a match;
- the longest specific match wins, unless that replica has more than `spill_threshold` requests in
  flight beyond the least loaded one: then the request spills to the least loaded;
- no match goes to the least loaded replica (ties broken at random, so groups spread evenly);
- a request that names its session (a client's `X-Session-ID`, one rollout's turns) goes where its session's last
  request went, as if that replica held its longest match (`SessionTable`, spill rule alike): a session's turns meet
  their KV blocks whatever their prompts' hashes say (a client that re-renders a turn's prompt, say).
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["affinity", "spilled", "unmatched"]
OUTCOMES: tuple[Outcome, ...] = ("affinity", "spilled", "unmatched")
# What became of a request that named its session: it stayed on the session's replica, spilled off it (overloaded),
# or started the session (its first request, or its replica left the fleet).
SessionOutcome = Literal["kept", "spilled", "new"]
SESSION_OUTCOMES: tuple[SessionOutcome, ...] = ("kept", "spilled", "new")
# A session's replica counts as a match deeper than any prompt's blocks.
SESSION_DEPTH = 1 << 40


def block_hashes(token_ids: Sequence[int], block_size: int, namespace: str) -> list[int]:
    """Chained 64-bit hashes of the full `block_size`-token blocks of `token_ids`, seeded with `namespace`.

    Block i's hash covers blocks 0..i and the namespace (the adapter name), exactly the property
    that makes vLLM's prefix cache reusable: equal hash, equal prefix, same adapter.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    digest = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
    full = len(token_ids) - len(token_ids) % block_size
    # 8-byte little-endian ints: any token id fits, and one bytes() call per prompt keeps this cheap.
    raw = array("q", token_ids[:full]).tobytes()
    step = 8 * block_size
    hashes = []
    for start in range(0, len(raw), step):
        digest = hashlib.blake2b(digest + raw[start : start + step], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
    return hashes


class PrefixTable:
    """Which replicas served which block hash: a bounded LRU map `hash -> {replica ids}`.

    Recorded when a request is routed (not when it finishes), so the rest of a group that arrives
    a moment later already matches. Bounded because a long run sees millions of prompts; the least
    recently used blocks go first, as they do in the engines' own caches.
    """

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._table: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def holders(self, block_hash: int) -> frozenset[str]:
        return frozenset(self._table.get(block_hash, ()))

    def match(self, hashes: Sequence[int], live: Iterable[str]) -> dict[str, int]:
        """Replica -> number of leading blocks it holds, counting only blocks some live replica lacks.

        The walk stops at the first block nobody live holds: the chain makes every later block a
        different prefix, so nothing past it can be in anyone's cache through this prompt.
        """
        live = frozenset(live)
        depth: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = self._table.get(h)
            holders = live.intersection(held) if held else frozenset()
            if not holders:
                break
            self._table.move_to_end(h)
            if holders == live:  # everyone has it: no preference, but deeper blocks may still tell apart
                continue
            for replica in holders:
                depth[replica] = i + 1
        return depth

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """Note that `replica` now holds these blocks (it is about to prefill them)."""
        for h in hashes:
            held = self._table.get(h)
            if held is None:
                self._table[h] = {replica}
            else:
                held.add(replica)
                self._table.move_to_end(h)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, replicas: Iterable[str]) -> None:
        """Drop replicas that died: their caches died with them, and a replacement starts cold."""
        gone = set(replicas)
        if not gone:
            return
        for h in list(self._table):
            held = self._table[h]
            held -= gone
            if not held:
                del self._table[h]


class SessionTable:
    """Which replica served each session last: a bounded LRU map `session -> replica`, as `PrefixTable` is for blocks."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._table: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def replica(self, session: str) -> str | None:
        held = self._table.get(session)
        if held is not None:
            self._table.move_to_end(session)
        return held

    def record(self, session: str, replica: str) -> None:
        self._table[session] = replica
        self._table.move_to_end(session)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, replicas: Iterable[str]) -> None:
        gone = set(replicas)
        for session in [s for s, r in self._table.items() if r in gone]:
            del self._table[session]


def session_outcome(held: str | None, loads: Mapping[str, int], decision: Decision) -> SessionOutcome:
    """What became of a session's request whose session was last on `held` (None: never seen)."""
    if held is None or held not in loads:
        return "new"
    return "kept" if decision.replica == held else "spilled"


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why."""

    replica: str
    outcome: Outcome
    matched_blocks: int = 0
    preferred: str | None = None  # the replica with the longest match (differs from `replica` on a spill)


def least_loaded(loads: Mapping[str, int], rng: random.Random) -> str:
    """The replica with the fewest requests in flight; ties at random so unmatched groups spread out."""
    low = min(loads.values())
    return rng.choice(sorted(r for r, n in loads.items() if n == low))


def decide(depths: Mapping[str, int], loads: Mapping[str, int], spill_threshold: int, rng: random.Random) -> Decision:
    """Pick a replica among `loads` (the live ones, with their in-flight counts) given the prefix `depths`."""
    if not loads:
        raise ValueError("no live replica to route to")
    matched = {r: d for r, d in depths.items() if r in loads and d > 0}
    target = least_loaded(loads, rng)
    if not matched:
        return Decision(target, "unmatched")
    best_depth = max(matched.values())
    # Equal matches (a prefix that spilled earlier lives on two replicas): the less loaded one.
    best = least_loaded({r: loads[r] for r, d in matched.items() if d == best_depth}, rng)
    if loads[best] - loads[target] > spill_threshold:
        return Decision(target, "spilled", best_depth, best)
    return Decision(best, "affinity", best_depth, best)
