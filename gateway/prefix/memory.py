"""In-memory prefix index (the embedded default, the Redis index's fallback, and the simulations' index).

The sync methods are the implementation (the discrete-event fleet simulation calls them directly); the async
ones satisfy the PrefixIndex protocol.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

DEFAULT_CAPACITY_CHUNKS = 2_400_000 // 256  # one MI355X TP4 rank's KV at the default chunk size


class MemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic, default_capacity: int = DEFAULT_CAPACITY_CHUNKS) -> None:
        self.clock = clock
        self.default_capacity = default_capacity
        self._entries: dict[int, dict[str, float]] = {}  # hash -> replica -> expiry
        self._lru: dict[str, OrderedDict[int, None]] = {}  # replica -> hashes, least recent first
        self._capacity: dict[str, int] = {}

    # -- sync core -------------------------------------------------------------------------------------------
    def match_sync(self, hashes: Sequence[int], replicas: Sequence[str] | None = None) -> dict[str, int]:
        now = self.clock()
        allowed = set(replicas) if replicas is not None else None
        alive: set[str] | None = None
        best: dict[str, int] = {}
        for i, h in enumerate(hashes):
            holders = self._entries.get(h)
            if not holders:
                break
            cur = {r for r, exp in holders.items() if exp > now and (alive is None or r in alive)
                   and (allowed is None or r in allowed)}
            if not cur:
                break
            for r in cur:
                best[r] = i + 1
            alive = cur
        return best

    def insert_sync(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        exp = self.clock() + ttl
        lru = self._lru.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # deepest first, so a prefix's leading chunks are the most recent: like the
            self._entries.setdefault(h, {})[replica] = exp  # engine, trimming removes the leaves of a path first
            lru[h] = None
            lru.move_to_end(h)
        cap = self._capacity.get(replica, self.default_capacity)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._forget(old, replica)

    def invalidate_sync(self, replica: str, hashes: Sequence[int]) -> None:
        lru = self._lru.get(replica)
        for h in hashes:
            self._forget(h, replica)
            if lru is not None:
                lru.pop(h, None)

    def drop_replica_sync(self, replica: str) -> None:
        for h in self._lru.pop(replica, OrderedDict()):
            self._forget(h, replica)

    def _forget(self, h: int, replica: str) -> None:
        holders = self._entries.get(h)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._entries[h]

    def set_capacity(self, replica: str, chunks: int) -> None:
        self._capacity[replica] = max(1, chunks)

    def size_sync(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def replicas(self) -> list[str]:
        return list(self._lru)

    # -- PrefixIndex protocol --------------------------------------------------------------------------------
    async def match(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        return self.match_sync(hashes, replicas)

    async def insert(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.insert_sync(replica, hashes, ttl)

    async def invalidate(self, replica: str, hashes: Sequence[int]) -> None:
        self.invalidate_sync(replica, hashes)

    def insert_soon(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.insert_sync(replica, hashes, ttl)

    def invalidate_soon(self, replica: str, hashes: Sequence[int]) -> None:
        self.invalidate_sync(replica, hashes)

    async def settle(self) -> None:
        return None

    async def drop_replica(self, replica: str) -> None:
        self.drop_replica_sync(replica)

    async def size(self) -> int:
        return self.size_sync()
