"""One asyncio lock per key, kept only while someone holds or waits for it: a fleet that runs for weeks sees
unbounded keys (adapter names, run names) come and go, and must not keep a lock for each one it ever saw."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holding or waiting


class KeyedLock:
    """`async with locks.hold(key):` one holder per key at a time."""

    def __init__(self):
        self._entries: dict[Hashable, _Entry] = {}

    def __len__(self) -> int:
        """Keys held or waited for now."""
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        entry = self._entries.setdefault(key, _Entry())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users and self._entries.get(key) is entry:
                del self._entries[key]
