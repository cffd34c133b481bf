"""The precise prefix index: a PrefixIndex (gateway/prefix/index.py) that answers from what the engines report.

It wraps the approximate index (memory or Redis, fed by the routing engine's dispatch feedback as before) and
answers per replica (`routing.mode`):
- precise: the replica's event-fed blocks, plus speculative entries from this instance's own dispatches that
  cover the event lag (a dispatch's entry lives `routing.speculative_ttl_s`, until its first token; the entry written at
  the first token lives `kv_events.speculative_s`, by when the engine's BlockStored has arrived);
- hybrid: the approximate index's answer or the events' answer, whichever is longer, with every removal, flush and
  restart the events report applied to the approximate index (so it stops predicting evicted prefixes);
- either mode, for a replica whose subscriptions are not all healthy (not discovered, disconnected, mid-resync):
  the approximate index's answer, per replica, so a lost subscription degrades routing and never fails a request.
  In precise mode the approximate index is asked only for those replicas (all healthy: no lookup there, so no Redis round trip).
Writes and drops go to both the approximate index and the speculative layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Protocol

from gateway.prefix.index import PrefixIndex
from gateway.prefix.memory import MemoryPrefixIndex


class HeldBlocks(Protocol):
    @property
    def held(self) -> Container[int]: ...


class RankView(Protocol):
    """What the index reads of a rank: the keys it holds (kvevents/blocks.RankBlocks) and its subscription's health."""

    @property
    def blocks(self) -> HeldBlocks: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def plain(self) -> bool:
        """Its events carry no namespace (<= 0.5.13): looked up with the request's plain keys."""


class PreciseIndex:
    def __init__(self, inner: PrefixIndex, mode: str, ranks_for: Callable[[str], Sequence[RankView] | None], *,
                 dispatch_ttl_s: float, lag_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 plain_of: Mapping[int, int] | None = None) -> None:
        self.inner = inner
        self.mode = mode  # precise | hybrid
        self.ranks_for = ranks_for  # index key (name@incarnation) -> the ranks it stands for (None: not subscribed)
        self.dispatch_ttl_s = dispatch_ttl_s
        self.lag_ttl_s = lag_ttl_s
        self.spec = MemoryPrefixIndex(clock=clock)
        self.answers = {"events": 0, "fallback": 0}  # replica answers by source (metrics)
        self.plain_of = plain_of  # namespaced request key -> its plain key (kvevents/request_keys.py)

    async def match(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        views = {key: self._healthy_ranks(key) for key in replicas}
        # precise with every replica on its events: the approximate index is not asked (no Redis round trip)
        need = [k for k, v in views.items() if v is None] if self.mode == "precise" else list(replicas)
        approx = await self.inner.match(hashes, need) if need else {}
        return self.combine(hashes, replicas, approx, views)

    def _healthy_ranks(self, key: str) -> Sequence[RankView] | None:
        ranks = self.ranks_for(key)
        return ranks if ranks and all(r.healthy for r in ranks) else None

    def combine(self, hashes: Sequence[int], replicas: Sequence[str], approx: dict[str, int],
                views: dict[str, Sequence[RankView] | None] | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in replicas:
            ranks = views[key] if views is not None else self._healthy_ranks(key)
            if ranks is None:
                self.answers["fallback"] += 1
                n = approx.get(key, 0)
            else:
                self.answers["events"] += 1
                n = self._run(key, hashes, ranks)
                if self.mode == "hybrid":
                    n = max(n, approx.get(key, 0))
            if n:
                out[key] = n
        return out

    def _run(self, key: str, hashes: Sequence[int], ranks: Sequence[RankView]) -> int:
        """Longest run of leading keys held by one of the ranks or speculatively by this replica."""
        spec = self.spec.match_sync(hashes, [key]).get(key, 0)
        n = 0
        helds = [r.blocks.held for r in ranks if not r.plain]
        plain = [r.blocks.held for r in ranks if r.plain]
        table = self.plain_of if plain and self.plain_of is not None else {}
        for i, h in enumerate(hashes):
            if i < spec or any(h in held for held in helds) or (plain and any(table.get(h, h) in p for p in plain)):
                n = i + 1
            else:
                break
        return n

    def _spec_ttl(self, ttl: float) -> float:
        # a dispatch's entry stands until its first token; later ones only until the events have caught up
        return ttl if ttl <= self.dispatch_ttl_s else self.lag_ttl_s

    async def insert(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.spec.insert_sync(replica, hashes, self._spec_ttl(ttl))
        await self.inner.insert(replica, hashes, ttl)

    async def invalidate(self, replica: str, hashes: Sequence[int]) -> None:
        self.spec.invalidate_sync(replica, hashes)
        await self.inner.invalidate(replica, hashes)

    def insert_soon(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.spec.insert_sync(replica, hashes, self._spec_ttl(ttl))
        self.inner.insert_soon(replica, hashes, ttl)

    def invalidate_soon(self, replica: str, hashes: Sequence[int]) -> None:
        self.spec.invalidate_sync(replica, hashes)
        self.inner.invalidate_soon(replica, hashes)

    async def settle(self) -> None:
        await self.inner.settle()

    async def drop_replica(self, replica: str) -> None:
        self.spec.drop_replica_sync(replica)
        await self.inner.drop_replica(replica)

    def set_capacity(self, replica: str, chunks: int) -> None:
        self.spec.set_capacity(replica, chunks)
        self.inner.set_capacity(replica, chunks)

    async def size(self) -> int:
        return await self.inner.size()

    # -- the same, synchronously, over an in-memory approximate index (the virtual-clock fleet: gateway_lab/replay/kv_modes.py)
    def match_sync(self, hashes: Sequence[int], replicas: Sequence[str] | None = None) -> dict[str, int]:
        keys = list(replicas) if replicas is not None else []
        return self.combine(hashes, keys, self.inner.match_sync(hashes, keys))  # type: ignore[attr-defined]

    def insert_sync(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.spec.insert_sync(replica, hashes, self._spec_ttl(ttl))
        self.inner.insert_sync(replica, hashes, ttl)  # type: ignore[attr-defined]

    def invalidate_sync(self, replica: str, hashes: Sequence[int]) -> None:
        self.spec.invalidate_sync(replica, hashes)
        self.inner.invalidate_sync(replica, hashes)  # type: ignore[attr-defined]

    def drop_replica_sync(self, replica: str) -> None:
        self.spec.drop_replica_sync(replica)
        self.inner.drop_replica_sync(replica)  # type: ignore[attr-defined]
