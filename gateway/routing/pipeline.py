"""The routing seam in the gateway: candidates -> one batched prefix lookup + one load snapshot (the only I/O) ->
the routing engine's decision (`routing/engine.py`, the same synchronous core the virtual-clock fleet runs).
Handlers and the dispatcher only see `Router.decide`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from gateway.config import ModelRoute
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.index import PrefixIndex
from gateway.routing.candidates import candidates
from gateway.routing.decision import Decision
from gateway.routing.engine import RoutingEngine, merged_load  # noqa: F401 (re-exported)
from gateway.routing.features import TargetInfo
from gateway.routing.load import LoadTracker
from gateway.routing.request import RoutingRequest
from gateway.upstreams import Target, UpstreamRegistry


class Router(Protocol):
    async def decide(self, req: RoutingRequest, route: ModelRoute) -> Decision: ...


def target_info(t: Target) -> TargetInfo:
    return TargetInfo(t.name, t.index_key, t.pool, t.timing, t.pricing, t, t.weight, prefix_cache=t.caps.prefix_cache)


class PipelineRouter:
    def __init__(self, registry: UpstreamRegistry, index: PrefixIndex, loads: LoadTracker, engine: RoutingEngine,
                 on_lookup: Callable[[float], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = registry
        self.index = index
        self.loads = loads
        self.engine = engine
        self.on_lookup = on_lookup

    @property
    def corrector(self) -> TtftCorrector:
        return self.engine.corrector

    async def decide(self, req: RoutingRequest, route: ModelRoute) -> Decision:
        live, _ = candidates(route, self.registry)
        infos = [target_info(t) for t in live]
        start = time.perf_counter()
        if self.engine.uses_prefix and req.hashes and infos:
            matches, tracked = await asyncio.gather(self.index.match(req.hashes, [i.key for i in infos]),
                                                    self.loads.snapshot([i.name for i in infos]))
        else:
            matches, tracked = {}, await self.loads.snapshot([i.name for i in infos])
        if self.on_lookup:
            self.on_lookup(time.perf_counter() - start)
        return self.engine.decide(req, infos, matches, tracked, self.clock(), {t.name: t.engine_load for t in live})
