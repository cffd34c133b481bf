"""State changes after the outcome is known: the prefix index, the shared load and the TTFT corrector.

- dispatched: a speculative index entry (short TTL) and the request's uncached tokens as queued prefill;
- first token: the entry is confirmed for the residency TTL; prefill load released; TTFT observed vs predicted;
- usage: the engine's cached_tokens below the prediction -> the entries beyond the real hit are invalidated
  (stale state after a restart or a silent eviction corrects itself);
- finished / failed: in-flight released; a failed attempt's speculative entries are withdrawn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from gateway.config import Routing
from gateway.observability.metrics import GatewayMetrics
from gateway.prediction.ttft import FREE, TtftCorrector
from gateway.prefix.index import PrefixIndex
from gateway.routing.decision import Decision
from gateway.routing.load import LoadTracker
from gateway.routing.request import RoutingRequest

log = logging.getLogger("gateway.feedback")


class Attempt:
    """One dispatch of a request to one target, with the features it was chosen on."""

    def __init__(self, req: RoutingRequest, target: Any, decision: Decision) -> None:
        self.req = req
        self.target = target
        cand = decision.features.get(target.name)
        self.key = target.index_key
        self.predicted_cached = cand.cached_tokens if cand else 0
        self.matched_chunks = cand.matched_chunks if cand else 0
        self.uncached = cand.uncached_tokens if cand else req.prompt_tokens
        self.ttft_raw = cand.ttft_raw if cand else 0.0
        self.ttft = cand.ttft if cand else 0.0
        self.regime = cand.regime if cand else FREE
        self.prefill_open = False
        self.open = False


class Feedback:
    def __init__(self, index: PrefixIndex, loads: LoadTracker, corrector: TtftCorrector, metrics: GatewayMetrics,
                 cfg: Routing) -> None:
        self.index = index
        self.loads = loads
        self.corrector = corrector
        self.metrics = metrics
        self.cfg = cfg
        self._tasks: set[asyncio.Task[Any]] = set()

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def dispatched(self, a: Attempt) -> None:
        a.open = a.prefill_open = True
        coros = [self.loads.add(a.target.name, a.uncached, 1)]
        if a.req.hashes and a.target.kind == "sglang":
            coros.append(self.index.insert(a.key, a.req.hashes, self.cfg.speculative_ttl_s))
        await asyncio.gather(*coros)
        self.metrics.replica_share.labels(a.target.pool, a.target.name).inc()

    def first_token(self, a: Attempt, observed_ttft: float | None) -> None:
        if a.prefill_open:
            a.prefill_open = False
            self._background(self.loads.prefill_done(a.target.name, a.uncached))
        if a.req.hashes and a.target.kind == "sglang":
            self._background(self.index.insert(a.key, a.req.hashes, self.cfg.residency_ttl_s))
        if observed_ttft is not None and a.ttft_raw > 0:
            self.corrector.observe(a.target.pool, a.ttft_raw, observed_ttft, a.regime)
            sla = a.req.ttft_sla_s
            self.metrics.sla.labels(a.req.tenant, "met" if observed_ttft <= sla else "missed").inc()

    def usage(self, a: Attempt, reported_cached: int | None) -> None:
        if reported_cached is None or a.target.kind != "sglang":
            return
        self.metrics.cached_predicted.labels(a.target.pool).inc(a.predicted_cached)
        self.metrics.cached_reported.labels(a.target.pool).inc(reported_cached)
        chunk = self.cfg.chunk_tokens
        if a.req.hashes and reported_cached < a.predicted_cached - chunk:
            real_chunks = reported_cached // chunk
            self.metrics.index_corrections.labels(a.target.pool).inc()
            self._background(self.index.invalidate(a.key, a.req.hashes[real_chunks:a.matched_chunks]))

    def finished(self, a: Attempt, failed: bool = False) -> None:
        before_first_token = a.prefill_open
        if a.prefill_open:
            a.prefill_open = False
            self._background(self.loads.prefill_done(a.target.name, a.uncached))
        if a.open:
            a.open = False
            self._background(self.loads.finish(a.target.name, 1))
        if failed and before_first_token and a.req.hashes and a.target.kind == "sglang":
            # the replica never prefilled this prompt: withdraw the speculative entries beyond what it held
            self._background(self.index.invalidate(a.key, a.req.hashes[a.matched_chunks:]))

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
