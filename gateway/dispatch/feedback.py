"""The one writer of routing state: the prefix index and the load (Redis or memory) change only here, each change
as an event from where it is known (tests/dispatch/test_one_writer.py keeps every other module to reads).

Request outcomes: the routing engine (`routing/engine.py`) says what changes — index confirm/correct/withdraw, load
release, TTFT learning — and this module applies it and counts it in the metrics. The virtual-clock fleet applies
the same engine's effects to its in-memory state (`apply_effects`), so there is one set of rules.

- dispatched: a speculative index entry (short TTL) and the request's uncached tokens as queued prefill;
- first token: the entry is confirmed for the residency TTL; prefill load released; TTFT observed vs predicted;
- usage: the engine's cached_tokens below the prediction -> the entries beyond the real hit are invalidated
  (stale state after a restart or a silent eviction corrects itself);
- finished / failed: in-flight released; a failed attempt's speculative entries are withdrawn.
Each is in this instance's view at once and reaches the shared store with the other writes no request waits for,
one exchange for all that were made since the last (`gateway/write_behind.py`).

Events from outside the request path:
- replica facts (the engine poller): an index key out of use (a new incarnation, a DP split or merge) is dropped; the
  engine's KV capacity bounds the index's entries per replica;
- flushes (the admin API here, the control plane from other instances): the replica's entries are dropped;
- KV events (precise/hybrid): a rank's cleared or removed blocks correct the approximate index under the precise one.

Per replica it also records what was observed — TTFT against the prediction, inter-token latency, each attempt's
outcome — in `ReplicaStats` and the `gateway_replica_*` metrics, and lets the latency outlier detector
(`outliers.py`) judge the pool on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway.config import Routing
from gateway.dispatch.outliers import LatencyOutliers
from gateway.dispatch.replica_stats import ReplicaStats
from gateway.observability.metrics import GatewayMetrics
from gateway.prefix.index import PrefixIndex
from gateway.routing.engine import Attempt, Effect, IndexWrite, LoadDelta, RoutingEngine
from gateway.routing.load import LoadTracker, Reservations

log = logging.getLogger("gateway.feedback")

__all__ = ["Attempt", "Feedback", "apply_effects"]


class Feedback:
    def __init__(self, index: PrefixIndex, loads: LoadTracker, engine: RoutingEngine, metrics: GatewayMetrics,
                 cfg: Routing, reservations: Reservations | None = None, approximate: PrefixIndex | None = None,
                 outliers: LatencyOutliers | None = None) -> None:
        self.reservations = reservations  # the router's decision-time claims, dropped once the dispatch is counted
        self.index = index
        self.approximate = approximate or index  # what KV events correct: the index under the precise one
        self.loads = loads
        self.engine = engine
        self.metrics = metrics
        self.cfg = cfg
        self._tasks: set[asyncio.Task[Any]] = set()
        # metric children by label values, looked up once: prometheus' labels() costs ~2 us a call, and these
        # run on every request (pools and replicas are few and fixed)
        self._share: dict[tuple[str, str], Any] = {}
        self._cached: dict[str, tuple[Any, Any]] = {}
        self._replica: dict[str, tuple[Any, Any, Any, Any]] = {}  # name -> (ttft, itl, predicted, correction)
        self.outliers = outliers
        self.stats = outliers.stats if outliers is not None else ReplicaStats()

    def _replica_metrics(self, pool: str, name: str) -> tuple[Any, Any, Any, Any]:
        m = self._replica.get(name)
        if m is None:
            mm = self.metrics
            m = self._replica[name] = (mm.replica_ttft.labels(pool, name), mm.replica_itl.labels(pool, name),
                                       mm.replica_ttft_predicted.labels(pool, name),
                                       mm.replica_correction.labels(pool, name))
        return m

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _apply(self, effects: Sequence[Effect]) -> None:
        apply_effects(effects, self.index, self.loads)

    def dispatched(self, a: Attempt) -> None:
        """The load and the speculative prefix entry: in this instance's view at once, in the shared store with the
        next exchange (sent on the loop's next turn when none is under way). Awaiting the entry held the upstream
        send for a round trip and showed it to no one sooner: a request decided meanwhile anywhere misses it
        either way."""
        self._apply(self.engine.dispatched(a))
        self.stats.prefill(a.name, a.uncached, a.queued_prefill)  # prefill it runs: its streams' tokens wait for it
        if self.reservations is not None:  # after: briefly counted twice rather than not at all
            self.reservations.release(a.req.request_id)
        share = self._share.get((a.pool, a.name))
        if share is None:
            share = self._share[(a.pool, a.name)] = self.metrics.replica_share.labels(a.pool, a.name)
        share.inc()
        if a.ttft > 0:
            self._replica_metrics(a.pool, a.name)[2].set(a.ttft)

    def first_token(self, a: Attempt, observed_ttft: float | None, at: float | None = None) -> None:
        """`observed_ttft`: from the request's arrival (what the client waited: the SLA metric); `at`: when the first
        token came (monotonic). What is learned about the target — the TTFT correction, the outlier residual, its
        observed TTFT (histogram, admin state) — is what the target took, from `a.sent_at` to `at`: the prediction
        is of the target's queue and prefill at the decision, and a request flow control held for seconds, or one
        sent after a failed attempt, would otherwise teach them that the target is slow by the gateway's own wait."""
        engine_ttft = observed_ttft
        if observed_ttft is not None and at is not None and a.sent_at > 0:
            engine_ttft = min(observed_ttft, max(0.0, at - a.sent_at))
        self._apply(self.engine.first_token(a, engine_ttft))
        if observed_ttft is not None and engine_ttft is not None and a.ttft_raw > 0:
            self.metrics.sla.labels(a.req.tenant, "met" if observed_ttft <= a.req.ttft_sla_s else "missed").inc()
            ttft, _, _, correction = self._replica_metrics(a.pool, a.name)
            ttft.observe(engine_ttft)
            corrector = self.engine.corrector
            correction.set(corrector.replica_factor(a.name))
            # the residual against the pool's prediction, not the replica's own: comparable across its peers
            self.stats.ttft(a.name, engine_ttft, a.ttft_raw * corrector.get(a.pool, a.regime))
            self._judge()

    def itl(self, a: Attempt, seconds_per_token: float, decode_s: float | None) -> None:
        """A served stream's mean inter-token latency (first token to the end, over the tokens after the first) and
        its decode share (`decode_s`: without the prefills that cut in; dispatch/replica_stats.py `judged_itl`; None:
        nothing to judge the replica on): the metric shows what the client saw, the outlier detector judges the
        replica's own speed."""
        if seconds_per_token <= 0:
            return
        self._replica_metrics(a.pool, a.name)[1].observe(seconds_per_token)
        if decode_s is not None:
            self.stats.itl(a.name, seconds_per_token, decode_s)
            self._judge()

    def outcome(self, target: Any, kind: str) -> None:
        """One attempt's end as far as the replica is concerned: ok | error | timeout."""
        self.stats.outcome(target.name, kind)

    def _judge(self) -> None:
        if self.outliers is not None:
            self.outliers.tick()

    def usage(self, a: Attempt, reported_cached: int | None) -> None:
        if reported_cached is None or not (a.info and a.info.prefix_cache):
            return
        pair = self._cached.get(a.pool)
        if pair is None:
            pair = self._cached[a.pool] = (self.metrics.cached_predicted.labels(a.pool),
                                           self.metrics.cached_reported.labels(a.pool))
        pair[0].inc(a.predicted_cached)
        pair[1].inc(reported_cached)
        effects = self.engine.usage(a, reported_cached)
        if effects:  # a correction: the engine holds less than the index said
            self.metrics.index_corrections.labels(a.pool).inc()
        self._apply(effects)

    def finished(self, a: Attempt, failed: bool = False) -> None:
        self._apply(self.engine.finished(a, failed))
        if self.outliers is not None:
            self.outliers.attempt_ended(a.name, a.req.request_id)  # a probing replica's slot is free again

    # -- replica facts (the engine poller) ------------------------------------------------------------------------
    async def replica_replaced(self, key: str) -> None:
        """An index key no longer in use (a new incarnation, a DP split or merge): its entries describe nothing."""
        await self.index.drop_replica(key)

    def replica_capacity(self, key: str, chunks: int) -> None:
        self.index.set_capacity(key, chunks)

    # -- control: on-call flushes (the admin API on this instance, the control plane from the others) -----------
    async def flushed(self, keys: Sequence[str]) -> None:
        for key in keys:
            await self.index.drop_replica(key)

    # -- KV events (precise/hybrid): corrections of the approximate index --------------------------------------
    def kv_cleared(self, key: str) -> None:
        self._background(self.approximate.drop_replica(key))

    def kv_removed(self, key: str, hashes: Sequence[int]) -> None:
        self.approximate.invalidate_soon(key, hashes)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await asyncio.gather(self.index.settle(), self.approximate.settle(), self.loads.settle())


def apply_effects(effects: Sequence[Effect], index: PrefixIndex, loads: LoadTracker) -> None:
    """Apply a request's effects: in this instance's view at once, in a shared store's copy with the other writes no
    one waits for (`gateway/write_behind.py`); the virtual-clock fleet applies them to its in-memory state the same
    way."""
    for e in effects:
        if isinstance(e, LoadDelta):
            loads.apply(e.replica, e.prefill_tokens, e.requests)
        elif isinstance(e, IndexWrite):
            index.insert_soon(e.replica, e.hashes, e.ttl)
        elif e.hashes:
            index.invalidate_soon(e.replica, e.hashes)
