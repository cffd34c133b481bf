"""The routing seam: candidates -> features (one batched prefix lookup + one load snapshot) -> pure policy ->
Decision. Handlers and the dispatcher only see `Router.decide`; policies never do I/O, so the same code runs in
the discrete-event fleet simulation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from gateway.config import ModelRoute
from gateway.prediction.ttft import LoadView, TtftCorrector
from gateway.prefix.index import PrefixIndex
from gateway.routing.candidates import candidates
from gateway.routing.decision import Decision
from gateway.routing.features import Candidate, TargetInfo, build_candidates
from gateway.routing.load import LoadTracker
from gateway.routing.request import RoutingRequest
from gateway.upstreams import Target, UpstreamRegistry

Policy = Callable[[RoutingRequest, Sequence[Candidate], Any], Decision]


class Router(Protocol):
    async def decide(self, req: RoutingRequest, route: ModelRoute) -> Decision: ...


def target_info(t: Target) -> TargetInfo:
    return TargetInfo(t.name, t.index_key, t.pool, t.timing, t.pricing, t, t.weight)


def merged_load(tracked: LoadView, engine: LoadView | None) -> LoadView:
    """The gateways' count, floored by the engine's own gauges (which lag, but see traffic from anywhere)."""
    if engine is None:
        return tracked
    return LoadView(max(tracked.queued_prefill_tokens, engine.queued_prefill_tokens), max(tracked.inflight, engine.inflight))


class PipelineRouter:
    def __init__(self, registry: UpstreamRegistry, index: PrefixIndex, loads: LoadTracker, corrector: TtftCorrector,
                 policy: Policy, params: Any, chunk_tokens: int, uses_prefix: bool = True,
                 on_lookup: Callable[[float], None] | None = None) -> None:
        self.registry = registry
        self.index = index
        self.loads = loads
        self.corrector = corrector
        self.policy = policy
        self.params = params
        self.chunk_tokens = chunk_tokens
        self.uses_prefix = uses_prefix
        self.on_lookup = on_lookup

    async def decide(self, req: RoutingRequest, route: ModelRoute) -> Decision:
        live, _ = candidates(route, self.registry)
        infos = [target_info(t) for t in live]
        start = time.perf_counter()
        if self.uses_prefix and req.hashes and infos:
            matches, tracked = await asyncio.gather(self.index.match(req.hashes, [i.key for i in infos]),
                                                    self.loads.snapshot([i.name for i in infos]))
        else:
            matches, tracked = {}, await self.loads.snapshot([i.name for i in infos])
        if self.on_lookup:
            self.on_lookup(time.perf_counter() - start)
        loads = {t.name: merged_load(tracked.get(t.name, LoadView()), t.engine_load) for t in live}
        cands = build_candidates(req, infos, matches, loads, self.corrector.get, self.chunk_tokens)
        decision = self.policy(req, cands, self.params)
        if len(decision.features) < len(cands):  # keep every candidate's features for feedback and explain
            decision = replace(decision, features={c.name: c for c in cands})
        return decision
