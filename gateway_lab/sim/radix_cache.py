"""A paged prefix cache with the observable behaviour of SGLang's radix cache.

A prompt is cut into full pages; page i is keyed by a chain hash of (key of page i-1, tokens of page i), seeded
by the request's namespace (cache_salt + extra_key), so equal keys mean equal prefixes in the same namespace.
That is a radix tree with edges split at page boundaries, stored as a dict from chain key to node.

- Matching walks the chain until the first missing page and refreshes every matched node's access time.
- Nodes on a running request's path are locked (ref-counted) and never evicted.
- Eviction removes least-recently-used unlocked *leaves*, repeatedly (a parent becomes a leaf when its last
  child goes), as `--radix-eviction-policy lru` does.
- With `events` set (`--kv-events-config`, gateway_lab/sim/kv_events.py), every page stored, evicted or flushed is
  reported to it as SGLang's BlockStored / BlockRemoved / AllBlocksCleared, with the engine's page hashes. The
  page's tokens are remembered from `page_keys` (a bounded FIFO, refreshed by every request that keys them).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(eq=False, slots=True)
class Node:
    key: int
    parent: Node | None
    children: int = 0
    lock: int = 0
    last_access: float = 0.0
    stamp: int = 0
    digest: bytes = b""  # the engine's SHA-256 page digest (only with events on)
    event_hash: int = 0  # its published form (first 8 bytes, signed big-endian)


class CacheEvents(Protocol):
    """Receives what the cache does, page by page (gateway_lab/sim/kv_events.py turns it into SGLang's events)."""

    def stored(self, nodes: Sequence[Node], parent: Node | None, tokens: bytes, salt: str | None) -> None: ...

    def removed(self, node: Node) -> None: ...

    def cleared(self) -> None: ...

    def root_digest(self, salt: str | None) -> bytes: ...


PENDING_PAGES = 65_536  # page tokens kept between a request's submission and its prefill (FIFO beyond)


@dataclass
class CacheStats:
    inserted_pages: int = 0
    evicted_pages: int = 0
    flushes: int = 0


@dataclass
class PrefixCache:
    page_size: int
    nodes: dict[int, Node] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    _heap: list[tuple[float, int, int, Node]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    locked_pages: int = 0
    events: CacheEvents | None = None
    _pending: OrderedDict[int, tuple[bytes, str | None]] = field(default_factory=OrderedDict)

    # -- keys -------------------------------------------------------------------------------------------------
    def page_keys(self, tokens: np.ndarray | Sequence[int], namespace: str = "") -> list[int]:
        """Chain keys of the full pages of `tokens` (a trailing partial page has no key)."""
        arr = np.asarray(tokens, dtype=np.uint32)
        ps = self.page_size
        n_pages = len(arr) // ps
        key = hash(("ns", namespace))
        keys = []
        raw = arr[: n_pages * ps].tobytes()
        step = ps * 4
        if ps == 1:
            for t in arr.tolist():
                key = hash((key, t))
                keys.append(key)
            if self.events is not None:  # 1-token pages publish events too (0.5.13 on the CPU serves with them)
                self._remember(keys, raw, step, namespace)
            return keys
        for i in range(n_pages):
            key = hash((key, raw[i * step : (i + 1) * step]))
            keys.append(key)
        if self.events is not None:
            self._remember(keys, raw, step, namespace)
        return keys

    def _remember(self, keys: list[int], raw: bytes, step: int, namespace: str) -> None:
        salt = namespace.split("\x00", 1)[0] or None  # the sim's namespace is cache_salt NUL extra_key
        pending = self._pending
        for i, k in enumerate(keys):
            pending[k] = (raw[i * step : (i + 1) * step], salt)
            pending.move_to_end(k)
        while len(pending) > PENDING_PAGES:
            pending.popitem(last=False)

    # -- queries ----------------------------------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return len(self.nodes) * self.page_size

    @property
    def locked_tokens(self) -> int:
        return self.locked_pages * self.page_size

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    def match(self, keys: Sequence[int], now: float) -> list[Node]:
        """Longest cached prefix (as nodes); refreshes access times along it."""
        path = []
        get = self.nodes.get
        for k in keys:
            node = get(k)
            if node is None:
                break
            path.append(node)
        if path:
            for node in path:
                node.last_access = now
            self._push(path[-1])
        return path

    # -- mutation ---------------------------------------------------------------------------------------------
    def insert(self, keys: Sequence[int], now: float, lock: bool = False) -> list[Node]:
        """Insert the chain `keys` (a full path from the root); returns its nodes, locked once more if `lock`."""
        path: list[Node] = []
        parent: Node | None = None
        new_from = -1
        for k in keys:
            node = self.nodes.get(k)
            if node is None:
                node = Node(k, parent)
                self.nodes[k] = node
                if parent is not None:
                    parent.children += 1
                self.stats.inserted_pages += 1
                if new_from < 0:
                    new_from = len(path)
            node.last_access = now
            path.append(node)
            parent = node
        if self.events is not None and new_from >= 0:
            self._report_stored(path[new_from:])
        if lock:
            self.lock(path)
        if path:
            self._push(path[-1])
        return path

    def lock(self, path: Sequence[Node]) -> None:
        for node in path:
            if node.lock == 0:
                self.locked_pages += 1
            node.lock += 1

    def unlock(self, path: Sequence[Node], now: float) -> None:
        for node in path:
            node.lock -= 1
            if node.lock == 0:
                self.locked_pages -= 1
            node.last_access = now
        if path:
            self._push(path[-1])

    def evict(self, n_tokens: int) -> int:
        """Evict LRU unlocked leaves until `n_tokens` are freed or nothing is evictable; returns tokens freed."""
        freed = 0
        heap = self._heap
        while freed < n_tokens and heap:
            _, stamp, _, node = heapq.heappop(heap)
            if (
                node.stamp != stamp
                or self.nodes.get(node.key) is not node
                or node.children
                or node.lock
            ):
                continue
            del self.nodes[node.key]
            self.stats.evicted_pages += 1
            if self.events is not None:
                self.events.removed(node)
            freed += self.page_size
            parent = node.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.lock == 0:
                    self._push(parent)
        if len(heap) > 4 * len(self.nodes) + 1024:
            self._rebuild_heap()
        return freed

    def compact(self) -> None:
        """Drop the heap entries every pop would skip (a newer push of the node, or the node gone), once they
        outnumber the live ones; the rest keep their keys, so eviction order is unchanged."""
        if len(self._heap) > 4 * len(self.nodes) + 1024:
            self._heap = [e for e in self._heap if e[3].stamp == e[1] and self.nodes.get(e[3].key) is e[3]]
            heapq.heapify(self._heap)

    def flush(self) -> None:
        self.nodes.clear()
        self._heap.clear()
        self.locked_pages = 0
        self.stats.flushes += 1
        self._pending.clear()
        if self.events is not None:
            self.events.cleared()

    def _report_stored(self, new: list[Node]) -> None:
        """Hash the new pages as the engine does (each page's digest chains on its parent's) and report them.
        New pages are contiguous: a path from the root is cached up to some page and new after it."""
        assert self.events is not None
        parent = new[0].parent
        chunks: list[bytes] = []
        salt: str | None = None
        for node in new:
            # read, not popped: a page evicted and stored again (by a request that keyed its prompt before the
            # first store) is reported again, as SGLang does; the FIFO bounds what is kept
            raw, salt = self._pending.get(node.key, (b"", None))
            if not raw:  # tokens forgotten (FIFO overflow): report what was hashed so far, skip the rest
                break
            prev = node.parent.digest if node.parent is not None else self.events.root_digest(salt)
            node.digest = hashlib.sha256(prev + raw).digest()
            node.event_hash = int.from_bytes(node.digest[:8], "big", signed=True)
            chunks.append(raw)
        if chunks:
            self.events.stored(new[: len(chunks)], parent, b"".join(chunks), salt)

    # -- heap bookkeeping (lazy: stale entries are skipped on pop) --------------------------------------------
    def _push(self, node: Node) -> None:
        node.stamp += 1
        heapq.heappush(self._heap, (node.last_access, node.stamp, next(self._seq), node))

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self.nodes.values():
            if node.children == 0:
                self._push(node)
