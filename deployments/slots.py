"""A replica's LoRA slots as a cache shared by every client: which adapter to evict when a load needs a slot.

vLLM holds at most `max_loras` adapters and, asked for one more, drops its least recently used one
without a word, even one that requests in flight still name. So the replica keeps the count itself
and chooses: never an adapter with requests in flight; first the least recently used of those that no
sample should still need, then (only when the pinned sets overflow the slots) the least recently
used pinned one. Pinned are, per family (`deployments.names`), the versions within `max_staleness`
of the family's newest loaded version: the ones a sample in flight may still name. An evicted bucket
version comes back from the bucket when it is next asked for, so eviction costs a reload, never a 404.

Pure logic: the replica feeds it what it holds, unit tests feed it numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from contracts.adapters import family_of


@dataclass(frozen=True)
class Held:
    """What eviction needs to know of a loaded adapter."""

    name: str
    last_used: float  # monotonic seconds of its latest load or request
    inflight: int


def pinned(names: Iterable[str], window: int) -> set[str]:
    """The versioned names within `window` versions of their family's newest: what samples may still use."""
    versions: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        family, version = family_of(name)
        if version is not None:
            versions.setdefault(family, []).append((version, name))
    return {name for held in versions.values() for version, name in held if version > max(held)[0] - window}


def eviction_order(held: Iterable[Held], window: int) -> list[str]:
    """The adapters that may leave the engine, first to go first: idle and unpinned by age of last use,
    then idle and pinned by age of last use. One with requests in flight is never listed."""
    held = list(held)
    keep = pinned((h.name for h in held), window)
    idle = sorted((h for h in held if h.inflight == 0), key=lambda h: h.last_used)
    return [h.name for h in idle if h.name not in keep] + [h.name for h in idle if h.name in keep]
