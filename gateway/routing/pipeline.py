"""The routing seam in the gateway: candidates -> one batched prefix lookup + one load snapshot (the only I/O) ->
the routing engine's decision (`routing/engine.py`, the same synchronous core the virtual-clock fleet runs).
Handlers and the dispatcher only see `Router.decide`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.index import PrefixIndex
from gateway.routing.candidates import candidates
from gateway.routing.decision import Decision
from gateway.routing.engine import RoutingEngine, merged_load  # noqa: F401 (re-exported)
from gateway.routing.features import TargetInfo
from gateway.routing.load import LoadTracker, Reservations
from gateway.routing.request import RoutingRequest
from gateway.settings.pools import ModelRoute
from gateway.upstreams import Target, UpstreamRegistry


class Router(Protocol):
    engine: RoutingEngine  # the decision core, for dry runs over past decisions (admin previews)

    async def decide(self, req: RoutingRequest, route: ModelRoute, dry_run: bool = False) -> Decision[Target]: ...


def target_info(t: Target) -> TargetInfo[Target]:
    return TargetInfo(t.name, t.index_key, t.pool, t.timing, t.pricing, t, t.weight, prefix_cache=t.caps.prefix_cache)


class PipelineRouter:
    def __init__(self, registry: UpstreamRegistry, index: PrefixIndex, loads: LoadTracker, engine: RoutingEngine,
                 on_lookup: Callable[[float], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 reservations: Reservations | None = None) -> None:
        self.clock = clock
        self.reservations = reservations or Reservations()  # claimed at decision, dropped at dispatch (load.py)
        self.registry = registry
        self.index = index
        self.loads = loads
        self.engine = engine
        self.on_lookup = on_lookup

    @property
    def corrector(self) -> TtftCorrector:
        return self.engine.corrector

    async def decide(self, req: RoutingRequest, route: ModelRoute, dry_run: bool = False) -> Decision[Target]:
        """`dry_run` (the admin explain): decide without claiming the chosen target's load."""
        live, _ = candidates(route, self.registry)
        infos = [target_info(t) for t in live]
        start = time.perf_counter()
        prefix = self.engine.uses_prefix and bool(req.hashes) and bool(infos)
        if prefix:
            matches, tracked = await asyncio.gather(self.index.match(req.hashes, [i.key for i in infos]),
                                                    self.loads.snapshot([i.name for i in infos]))
        else:
            matches, tracked = {}, await self.loads.snapshot([i.name for i in infos])
        if self.on_lookup:
            self.on_lookup(time.perf_counter() - start)
        if prefix and req.affinity_hint is not None:
            matches = self.hinted(req, infos, matches)
        # from here to the reservation nothing awaits: a decision sees every earlier one's claim
        tracked = self.reservations.overlay(tracked)
        decision = self.engine.decide(req, infos, matches, tracked, self.clock(), {t.name: t.engine_load for t in live})
        chosen = decision.chosen
        if chosen is not None and not dry_run:
            cand = decision.features.get(chosen.name)
            self.reservations.reserve(req.request_id, chosen.name, cand.uncached_tokens if cand else req.prompt_tokens)
        return decision

    def hinted(self, req: RoutingRequest, infos: list[TargetInfo[Target]], matches: dict[str, int]) -> dict[str, int]:
        """The hinted target holds at least the stored turn's prompt: its match is raised to the leading chunks
        that prompt covered (a floor; the index may know more). The policy itself is unchanged: a hinted replica
        that is drained, gone, or too slow for the SLA loses like any other."""
        info = next((i for i in infos if i.name == req.affinity_hint), None)
        depth = min(len(req.hashes), req.affinity_tokens // self.engine.chunk_tokens)
        if info is None or depth <= matches.get(info.key, 0):
            return matches
        return {**matches, info.key: depth}
