"""Accounting: the end of a request, as independent steps that each run whatever the others did.

`finish` runs exactly once per request (the orchestrator's `finally` for JSON responses, the stream's `on_close`
for SSE) and reads two values: the exchange (what was asked, what the stages returned) and the outcome (what the
relay learned as the answer arrived, pipeline/outcome.py). It writes neither, but for the outcome's once-only
mark: how the request ended as accounting settles it (a client that left named as such, a stream cut short billed
for what it relayed) is its own reading, shared by its steps. First, in a `finally` of their own, the releases that
shared state depends on: the replica's load in the shared load view (or every instance would see phantom requests
in flight and route around an idle replica) and the tenant's concurrency slot; then closing the upstream (cancels it
if the client left). Then usage, metrics, SLA, budget settlement, rate-limit adjustment, the recent-decisions ring,
the span and the log line. A failure inside a step is logged and counted (`gateway_accounting_failures_total{step}`) and the next step runs: none can change the
response already decided, nor turn a served 200 into a 500.

`refused` counts and logs a refusal, the one way every refusal is (pipeline/refusal.py): `rejected` for a request
the pipeline refused before its exchange existed (bad key, body, JSON, model, local cap), api/refusals.py for one
that never reached the pipeline.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.dispatch.dispatcher import Dispatched
from gateway.dispatch.feedback import Feedback
from gateway.dispatch.replica_stats import judged_itl
from gateway.observability.logging import log_request
from gateway.observability.metrics import Children, GatewayMetrics
from gateway.pipeline import idempotency
from gateway.pipeline.exchange import Exchange, RecentDecision
from gateway.pipeline.outcome import Outcome
from gateway.pipeline.refusal import Edge, Refused
from gateway.pipeline.relay import cost
from gateway.pipeline.telemetry import end_span
from gateway.pipeline.usage import usage_counts
from gateway.tenancy.budget import BudgetLedger, Usage
from gateway.tenancy.concurrency import ConcurrencyLimiter
from gateway.tenancy.ratelimit import RateLimiter

if TYPE_CHECKING:
    from gateway.recording.recorder import TraceRecorder
    from gateway.tenancy.idempotency import IdempotencyStore

log = logging.getLogger("gateway.accounting")

# The ends that are not a failure of the gateway or the upstream (span status stays unset, feedback not "failed").
CLEAN_ENDS = ("ok", "client_disconnect", "client_stall", "shutdown", "idempotent_replay")
# Streams ended before the engine's usage arrived, billed for what was relayed (`abandoned_usage`).
CUT_ENDS = ("client_disconnect", "client_stall", "shutdown")


def abandoned_usage(ex: Exchange, out: Outcome, predicted_cached: int) -> dict[str, Any]:
    """A client that leaves mid-stream (or a stream cut by shutdown) never gets the engine's usage chunk, yet the
    engine prefilled its prompt and generated until the cancel. Charge what the gateway knows: its own prompt count, the cache hit it predicted,
    and one token per content chunk relayed (a lower bound: an engine chunk carries >= 1 token)."""
    prompt = ex.parsed.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": max(out.chunks - 1, 0),  # minus the role chunk
            "prompt_tokens_details": {"cached_tokens": min(max(predicted_cached, 0), prompt)}}


@dataclass(frozen=True)
class Books:
    """What accounting settles a request against: exactly these of the app's parts, never the whole app state."""

    metrics: GatewayMetrics
    feedback: Feedback  # load, prefix entry, TTFT/ITL observations
    concurrency: ConcurrencyLimiter  # the tenant's slot
    budget: BudgetLedger  # the reservation, settled with the real cost
    limiter: RateLimiter  # the token buckets, adjusted to the real usage
    idempotency: IdempotencyStore | None  # a kept outcome for the client's Idempotency-Key
    recorder: TraceRecorder | None  # recording.path: one anonymized trace line
    models: frozenset[str]  # the configured model names: the only model label values
    log_requests: bool


class Accounting:
    def __init__(self, books: Books, recent: deque[RecentDecision],
                 background: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.books = books
        self.recent = recent
        self._background = background
        self._models = books.models
        m = books.metrics  # the children every request's end counts into, looked up once per label set
        self._requests, self._latency, self._ttft = Children(m, "requests"), Children(m, "latency"), Children(m, "ttft")
        self._tokens, self._cost, self._sla_count = Children(m, "tokens"), Children(m, "cost"), Children(m, "sla")
        self._inflight = Children(m, "inflight")

    def model_label(self, name: object) -> str:
        """A configured model's name, else "unknown": client-chosen strings never become label values."""
        return name if isinstance(name, str) and name in self._models else "unknown"

    def _step(self, name: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # the documented second broad catch: a step's failure stays in that step
            log.exception("accounting step %s failed", name)
            try:
                self.books.metrics.accounting_failures.labels(name).inc()
            except Exception:  # noqa: BLE001, S110 - even the failure counter must not escape; the failure is logged above
                pass

    # -- a refusal: before the exchange existed, or of a request that never reached the pipeline --------------------
    def rejected(self, edge: Edge, err: BaseException) -> None:
        self.refused(Refused.at_edge(edge, err))

    def refused(self, r: Refused) -> None:
        """The one way a refusal is counted and logged (pipeline/refusal.py)."""
        self._step("metrics", self._count_refusal, r)
        self._step("log", self._log_refusal, r)

    def _count_refusal(self, r: Refused) -> None:
        m = self.books.metrics
        m.requests.labels(r.model, "none", r.tenant, r.status, r.reason, r.api).inc()
        if r.timed:
            m.latency.labels(r.model, "none", r.tenant, r.api).observe(time.monotonic() - r.started)

    def _log_refusal(self, r: Refused) -> None:
        if not self.books.log_requests:
            return
        line: dict[str, Any] = {"request_id": r.request_id, "tenant": r.tenant, "model": r.logged_model or r.model,
                                "endpoint": r.endpoint, "api": r.api}
        if r.method is not None:
            line["method"] = r.method
        line.update({
            "stream": r.stream, "status": r.status, "reason": r.reason, "pool": "none", "replica": None, "route": None,
            "attempts": 0, "ttft_ms": None, "duration_ms": round((time.monotonic() - r.started) * 1000, 1),
            "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "error": r.error,
        })
        log_request(line)

    # -- the end of an admitted request -------------------------------------------------------------------------
    async def finish(self, ex: Exchange, out: Outcome, disconnected: bool) -> None:
        if out.accounted:
            return
        out.accounted = True
        now = time.monotonic()
        status, reason = out.status, out.reason
        if disconnected and reason == "ok":
            reason = "client_disconnect"
            if not (ex.parsed.stream and out.first_token_at is not None):  # no status line reached the client
                status = "499"
        d = out.dispatched
        try:
            self._step("release_load", self._release_load, ex, d, reason)
            self._step("release_slot", self._release_slot, ex)
            if d is not None:
                try:
                    await d.opened.close()  # for a client that left mid-stream this cancels the upstream request
                except Exception:  # closing a broken upstream connection can fail; nothing more to do
                    log.debug("closing the upstream of %s failed", ex.request_id, exc_info=True)
        finally:
            c = _Ctx(ex, out, status, reason, now)
            for name, step in (("usage", self._usage), ("metrics", self._metrics), ("sla", self._sla),
                               ("budget", self._settle), ("rate_limits", self._adjust_rate),
                               ("idempotency", self._idempotency), ("recent", self._recent),
                               ("record", self._record), ("span", self._span), ("log", self._log)):
                self._step(name, step, c)

    def _release_load(self, ex: Exchange, d: Dispatched | None, reason: str) -> None:
        if ex.rreq is not None and self.books.feedback.reservations is not None:
            self.books.feedback.reservations.release(ex.rreq.request_id)  # decided, then refused or failed early
        if d is not None:
            self.books.feedback.finished(d.attempt, failed=reason not in CLEAN_ENDS)

    def _release_slot(self, ex: Exchange) -> None:
        if ex.slot is not None:
            self.books.concurrency.release(ex.slot)
        self._inflight(ex.tenant.name).dec()

    def _usage(self, c: _Ctx) -> None:
        ex, out, d = c.ex, c.out, c.out.dispatched
        if d is None:
            return
        pool = d.target.pool
        for kind in out.usage_anomalies:
            self.books.metrics.usage_anomalies.labels(pool, kind).inc()
        if out.usage_anomalies:
            log.warning("upstream usage anomaly from %s/%s (request %s): %s; clamped", pool, d.target.name,
                        ex.request_id, ",".join(out.usage_anomalies))
        if out.usage is not None:
            self.books.feedback.usage(d.attempt, usage_counts(out.usage)[1])
        elif c.reason in CUT_ENDS and out.first_token_at is not None:
            c.usage = abandoned_usage(ex, out, d.attempt.predicted_cached)
        c.prompt, reported, c.completion = usage_counts(c.usage)
        c.cached = reported or 0
        c.cost = cost(d, c.usage)

    def _metrics(self, c: _Ctx) -> None:
        ex, out = c.ex, c.out
        model, tenant, pool = ex.route.name, ex.tenant.name, c.pool  # the served model: an alias's glob is no label
        self._requests(model, pool, tenant, c.status, c.reason, c.api).inc()
        self._latency(model, pool, tenant, c.api).observe(c.now - ex.started)
        if out.first_token_at is not None:
            self._ttft(model, pool, tenant, c.api).observe(out.first_token_at - ex.started)
        self._itl(c)
        if c.usage:
            self._tokens(model, pool, tenant, "uncached_prompt").inc(c.prompt - c.cached)
            self._tokens(model, pool, tenant, "cached_prompt").inc(c.cached)
            self._tokens(model, pool, tenant, "completion").inc(c.completion)
            self._cost(model, pool, tenant).inc(c.cost)

    def _itl(self, c: _Ctx) -> None:
        """A served stream's inter-token latency, for its replica: the mean (the time from the first token to the end
        over the tokens after the first, per choice: n choices decode side by side), what the client saw; and its
        decode share, what the replica's own speed made of it (dispatch/replica_stats.py `judged_itl`)."""
        ex, d, first = c.ex, c.out.dispatched, c.out.first_token_at
        if not ex.parsed.stream or c.reason != "ok" or d is None or first is None:
            return
        n = ex.parsed.body.get("n")
        per_choice = c.completion / (n if isinstance(n, int) and n > 1 else 1)
        if per_choice >= 2:
            mean = (c.now - first) / (per_choice - 1)
            t = d.target.timing
            self.books.feedback.itl(d.attempt, mean, judged_itl(mean, c.out.gaps, t.decode_step_s, t.tokens_per_step))

    def _sla(self, c: _Ctx) -> None:
        """Streams are judged on their observed TTFT (dispatch feedback). A non-streamed response has no first
        token the client sees; it is judged on its TTFT estimated as response time minus the decode time of the
        tokens it generated at the pool's full-batch decode rate (an upper bound on decode time, so the estimate
        leans towards "met" on a lightly loaded replica). Only served requests with usage are judged."""
        ex, d, first = c.ex, c.out.dispatched, c.out.first_token_at
        if ex.parsed.stream or c.reason != "ok" or d is None or ex.rreq is None or first is None or c.usage is None:
            return
        t = d.target.timing
        n = ex.parsed.body.get("n")
        choices = n if isinstance(n, int) and n > 1 else 1  # choices decode side by side in one batch
        decode_s = c.completion / choices / t.tokens_per_step * t.decode_step_s
        ttft_est = (first - ex.started) - decode_s
        self._sla_count(ex.tenant.name, "met" if ttft_est <= ex.rreq.ttft_sla_s else "missed").inc()

    def _settle(self, c: _Ctx) -> None:
        if c.ex.reservation is not None:
            used = Usage(c.cost, c.prompt, c.cached, c.completion) if c.usage else None
            self._background(self.books.budget.settle(c.ex.reservation, used))

    def _adjust_rate(self, c: _Ctx) -> None:
        used = c.prompt + c.completion if c.usage else 0
        for b in c.ex.buckets:
            if b.key.endswith(":tok") and b.cost != used:
                self._background(self.books.limiter.adjust(b, b.cost - used))

    def _idempotency(self, c: _Ctx) -> None:
        ex, store = c.ex, self.books.idempotency
        if ex.idem is not None and store is not None:
            ok = c.status == "200" and c.reason == "ok"
            self._background(idempotency.end(store, ex.idem, ex.tenant.name, ex.request_id, ok, ex.parsed.stream,
                                             c.out.headers))

    def _recent(self, c: _Ctx) -> None:
        ex, out, t = c.ex, c.out, c.out.served_by
        first = out.first_token_at
        ttft = first - ex.started if ex.parsed.stream and first is not None else None
        self.recent.append(RecentDecision(time.time(), ex.request_id, ex.tenant.name, ex.parsed.model, c.status,
                                          t.name if t is not None else None, out.attempts, ex.decision, ex.rreq,
                                          ttft, c.prompt if c.usage is not None else None,
                                          c.cached if c.usage is not None else None))

    def _record(self, c: _Ctx) -> None:
        """One anonymized trace line when `recording.path` is set (gateway/recording/recorder.py)."""
        if self.books.recorder is not None:
            self.books.recorder.record(c.ex.rreq, c.usage, c.ex.started)

    def _span(self, c: _Ctx) -> None:
        end_span(c.ex.span, c.ex.decision, c.out, c.status, c.reason, c.prompt, c.cached, c.completion)

    def _log(self, c: _Ctx) -> None:
        if not self.books.log_requests:
            return
        ex, out, t = c.ex, c.out, c.out.served_by
        first = out.first_token_at
        log_request({
            # request_id: the correlation id the client sent or got; gateway_id: the gateway's own (keys its spend)
            "request_id": ex.request_id, "gateway_id": ex.id, "tenant": ex.tenant.name, "model": ex.route.name,
            "endpoint": ex.endpoint,
            "requested_model": ex.parsed.model[:64] if ex.parsed.model != ex.route.name else None,
            "api": c.api, "stream": ex.parsed.stream, "status": c.status, "reason": c.reason, "pool": c.pool,
            "replica": t.name if t is not None else None, "route": ex.decision.branch if ex.decision else None,
            "attempts": out.attempts,
            "ttft_ms": round((first - ex.started) * 1000, 1) if first else None,
            "duration_ms": round((c.now - ex.started) * 1000, 1), "prompt_tokens": c.prompt,
            "cached_tokens": c.cached, "completion_tokens": c.completion, "cost_usd": round(c.cost, 8),
            "error": out.error[:200] if out.error else None,
            # what the upstream's usage claimed that had to be corrected (usage.py KINDS): billed as corrected
            "usage_anomalies": out.usage_anomalies or None,
        }, span=ex.span)


class _Ctx:
    """What the steps share: the exchange, the relay's outcome, and accounting's reading of how the request ended
    (`status`, `reason`: the outcome's, a client that left named as such; `usage`: the upstream's, or for a stream
    cut short what it relayed). Each value has a safe default should the step computing it fail."""

    def __init__(self, ex: Exchange, out: Outcome, status: str, reason: str, now: float) -> None:
        self.ex, self.out = ex, out
        self.now = now
        self.status, self.reason = status, reason
        self.usage = out.usage
        t = out.served_by
        self.pool = t.pool if t is not None else "none"
        self.api = ex.call.api_for(ex.endpoint)
        self.prompt = self.cached = self.completion = 0
        self.cost = 0.0

