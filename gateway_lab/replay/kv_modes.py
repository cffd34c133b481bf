"""`routing.mode` precise and hybrid on the virtual clock (`gateway replay --modes`, gateway_lab/sim/fleet.py).

Each gateway instance's index becomes the gateway's own `PreciseIndex` around its approximate index; the
event-fed view it consults is the engine rank's radix cache itself, read at decision time: the subscriptions' best
case (no lag, no lost batch), against which the HTTP runs (loadtests/kv_events_modes.py) show the real transport.
A routing chunk counts as held when the rank holds the page that closes it (the engine evicts leaves first, so that
page implies the pages before it). In hybrid mode the rank's evictions and flushes are applied to every instance's
approximate index, as the event consumer does (kvevents/manager.py), through the cache's event hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.config import Routing
from gateway.kvevents.index import PreciseIndex
from gateway_lab.sim.radix_cache import Node, PrefixCache


class _Held:
    """`chunk_hash in held`: the rank holds the page closing that chunk of the request being routed."""

    def __init__(self, owner: FleetPrecise, cache: PrefixCache) -> None:
        self.owner = owner
        self.cache = cache

    def __contains__(self, h: object) -> bool:
        page = self.owner.page_of.get(h)  # type: ignore[call-overload]
        return page is not None and page in self.cache.nodes


class _Blocks:
    def __init__(self, held: _Held) -> None:
        self.held = held


class _RankView:
    healthy = True
    plain = False

    def __init__(self, held: _Held) -> None:
        self.blocks = _Blocks(held)


class _Evictions:
    """A PrefixCache event sink that forwards evictions and flushes to the approximate indexes (hybrid)."""

    def __init__(self, owner: FleetPrecise, key: str) -> None:
        self.owner = owner
        self.key = key

    def root_digest(self, salt: str | None) -> bytes:
        return b""

    def stored(self, nodes: Sequence[Node], parent: Node | None, tokens: bytes, salt: str | None) -> None:
        return None

    def removed(self, node: Node) -> None:
        h = self.owner.chunk_of.get(node.key)
        if h is not None:
            for idx in self.owner.inners:
                idx.invalidate_sync(self.key, [h])

    def cleared(self) -> None:
        for idx in self.owner.inners:
            idx.drop_replica_sync(self.key)


class FleetPrecise:
    def __init__(self, fleet: Any, routing: Routing, page_size: int) -> None:
        self.every = max(1, routing.chunk_tokens // page_size)
        self.mode = routing.mode
        self.page_of: dict[int, int] = {}  # the routed request's chunk hash -> the page key closing that chunk
        self.chunk_of: dict[int, int] = {}  # hybrid: page key -> chunk hash, for every request routed so far
        views = {info.key: [_RankView(_Held(self, fleet.ranks[info.name].rank.cache))]
                 for info in fleet.infos if info.prefix_cache}
        self.inners: list[Any] = []
        for inst in fleet.instances:
            if all(inst.index is not x for x in self.inners):  # a shared (Redis) index gets the removals once
                self.inners.append(inst.index)
            # each instance its own PreciseIndex, as each gateway process has: its speculative (in-flight) entries
            # are its own, around the (maybe shared) approximate index
            inst.index = PreciseIndex(inst.index, routing.mode, lambda key: views.get(key),
                                      dispatch_ttl_s=routing.speculative_ttl_s,
                                      lag_ttl_s=routing.kv_events.speculative_s, clock=lambda: fleet.loop.now)
        if routing.mode == "hybrid":
            for info in fleet.infos:
                if info.prefix_cache:
                    fleet.ranks[info.name].rank.cache.events = _Evictions(self, info.key)
        fleet.on_job = self.prepare

    def prepare(self, job: Any) -> None:
        pages = job.page_keys
        e = self.every
        self.page_of = {h: pages[(j + 1) * e - 1] for j, h in enumerate(job.req.hashes) if (j + 1) * e <= len(pages)}
        if self.mode == "hybrid":
            for h, page in self.page_of.items():
                self.chunk_of[page] = h


def install(fleet: Any, routing: Routing, page_size: int) -> FleetPrecise | None:
    """Make `fleet` route in `routing.mode` (nothing to do for approximate)."""
    return None if routing.mode == "approximate" else FleetPrecise(fleet, routing, page_size)
