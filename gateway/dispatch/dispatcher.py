"""Dispatch: try the decision's ranked targets in order until one answers, before anything reached the client.

Per target: a quarantined body is refused before any attempt; the circuit breaker must grant a slot; the backend
opens the attempt (retrying a dropped pooled connection on the same replica) inside a first-byte wait the stall
detector can cut short (`ejection.py`). A failure is classified by cause (`retry_policy.py`) and only replica-level
evidence reaches the breaker:

- the request's fault (upstream 4xx, an engine 5xx that blames the input, the same 5xx on two replicas serving
  other traffic): a 4xx to the client, no further attempt, no breaker failure;
- the gateway's upstream credentials (401/403): the rest of that pool is skipped; a 502 that says so, logged;
- a timeout or broken connection: at most one other replica; twice -> the body is quarantined (422 from then on);
  it counts against the breaker only if the replica answered no one else while this request waited;
- refused connection, overload, a 5xx the same body did not meet elsewhere: the breaker, the next candidate.

Bounded by max_attempts and the total deadline. Every error raised after an attempt carries `attempts`, `target`
and `x-gateway-attempts`. With a tracer, each attempt is a CLIENT span (child of `parent`) and sends `traceparent`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.backends.base import AttemptFailed, Backend, Opened, UpstreamCall
from gateway.circuit_breaker import BreakerState
from gateway.config import GatewayConfig
from gateway.dispatch.ejection import StallDetector, Waiting
from gateway.dispatch.feedback import Attempt, Feedback
from gateway.dispatch.quarantine import BodyPrint, Quarantine
from gateway.dispatch.retry_policy import (
    Cause,
    classify,
    client_error,
    content_error,
    credentials_error,
    final_error,
)
from gateway.dispatch.upstream_body import adapt_body
from gateway.errors import GatewayError, NoCapacity, RequestQuarantined, UpstreamTimeout
from gateway.observability.logging import log_event
from gateway.observability.metrics import GatewayMetrics
from gateway.policy_schema import Tenant
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.upstreams import Target

log = logging.getLogger("gateway.dispatch")


@dataclass
class Dispatched:
    target: Target
    opened: Opened
    attempts: int
    attempt: Attempt


class _Tries:
    """One request's attempts so far: what failed where, for the classification rules."""

    def __init__(self, tenant: str | None = None) -> None:
        self.tenant = tenant  # whose body: its failures are one source of breaker evidence, whatever the body
        self.count = 0
        self.errors: list[AttemptFailed] = []
        self.last: Target | None = None
        self.hangs = 0
        self.suspect_5xx: list[Target] = []  # answered 5xx, verdict pending (replica or body)
        self.bad_pools: set[str] = set()  # pools whose credentials were rejected


class Dispatcher:
    def __init__(self, cfg: GatewayConfig, backends: dict[str, Backend], metrics: GatewayMetrics, feedback: Feedback,
                 quarantine: Quarantine | None = None, tracer: Any = None,
                 on_unreachable: Callable[[Target], None] = lambda t: None) -> None:
        """`on_unreachable`: told of a refused connection (HealthChecker.unreachable marks the target down)."""
        self.cfg = cfg
        self.on_unreachable = on_unreachable
        self.backends = backends
        self.metrics = metrics
        self.feedback = feedback
        r = cfg.retry
        self.quarantine = quarantine or Quarantine(r.quarantine_ttl_s)
        self.stalls = StallDetector(r.stall_s, r.stall_min_requests, self._ejected)
        self.tracer = tracer if tracer is not None and not isinstance(tracer, trace.NoOpTracer) else None
        self._creds_logged: dict[str, float] = {}

    async def open(self, decision: Decision[Target], req: RoutingRequest, body: dict[str, Any], deadline: float,
                   tenant: Tenant | None = None, parent: Any = None, boost: int = 0) -> Dispatched:
        """`parent`: the request's span (or an OTel Context) the attempt spans hang under; default the current one.
        `boost`: flow control's addition to the request's engine priority (`FlowController.engine_boost`), sent with
        its class and prefill level only where the target schedules by priority (`Target.priority_for`)."""
        endpoint, stream, request_id = req.endpoint, req.stream, req.request_id
        bp = BodyPrint(body)
        if await self.quarantine.blocked(bp):
            self.metrics.quarantine_refusals.inc()
            raise RequestQuarantined(
                "This request body timed out or broke the connection on two model server replicas and is refused for "
                f"another {self.quarantine.remaining_s(bp):.0f} s to protect the service; change the request (e.g. "
                "smaller n, max_tokens or prompt) rather than retrying it.", should_retry=False)
        tries = _Tries(tenant.name if tenant is not None else None)
        limit = self.cfg.retry.max_attempts
        for cand in decision.ranked:
            target = cand.info.ref
            if tries.count >= limit:
                break
            if target.pool in tries.bad_pools:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._tag(UpstreamTimeout("The request's total time budget ran out before an upstream answered.",
                                                should_retry=False), tries)
            # back from a latency ejection: one request at a time until it has shown it is well (probe_gate.py)
            if not target.state.probe.acquire(request_id):
                continue
            if not target.breaker.acquire():
                target.state.probe.release(request_id)
                continue
            tries.count += 1
            tries.last = target
            if tries.count > 1:
                self.metrics.retries.labels(target.pool).inc()
            first_byte = min(self.cfg.timeouts.first_byte, remaining)
            # the trial request to a replica ejected for stalling gets only stall_s to show it answers again: a
            # still-hung replica must not hold a client for a whole first-byte timeout every cooldown
            probing_stalled = target.breaker.state is BreakerState.HALF_OPEN and target.breaker.reason == "stalled"
            if probing_stalled:
                first_byte = min(first_byte, self.cfg.retry.stall_s)
            attempt = Attempt(req, target, decision)
            level = self.feedback.engine.prefill_level(attempt) + boost
            call = UpstreamCall(endpoint, adapt_body(body, target, stream, tenant, level), stream, request_id,
                                first_byte, routing=req)
            try:
                self.feedback.dispatched(attempt)
                attempt.sent_at = time.monotonic()
                opened = await self._attempt(target, call, attempt, bp, tries.count, parent)
            except AttemptFailed as e:
                self.feedback.finished(attempt, failed=True)
                tries.errors.append(e)
                if classify(e) is not Cause.REQUEST:  # the request's own fault says nothing about the replica
                    self.feedback.outcome(target, "timeout" if e.timeout else "error")
                if probing_stalled and e.timeout:  # still hung: open again; says nothing about this body
                    target.breaker.trip("stalled")
                    self.metrics.upstream_errors.labels(target.pool, target.name, "stalled").inc()
                    continue
                if (err := self._failed(target, e, bp, tries)) is not None:
                    raise self._tag(err, tries) from None
                if tries.hangs == 1:
                    limit = min(limit, tries.count + 1)  # a possible poison body gets one other replica, no more
                continue
            except BaseException:
                self.feedback.finished(attempt, failed=True)
                target.breaker.release()  # cancelled (client gone): no verdict on the replica
                raise
            target.breaker.success()
            self.feedback.outcome(target, "ok")
            for t in tries.suspect_5xx:  # the body worked here: those 5xx were the replicas'
                t.breaker.failure(None)
            return Dispatched(target, opened, tries.count, attempt)
        for t in tries.suspect_5xx:  # no other replica could tell (a pool of one): evidence from this tenant
            t.breaker.failure(bp.key, tries.tenant)
        if not tries.errors:
            raise self._tag(NoCapacity("No replica can take this request right now.", retry_after=1, should_retry=True), tries)
        if tries.bad_pools:
            raise self._tag(credentials_error(sorted(tries.bad_pools), tries.errors[-1]), tries)
        raise self._tag(final_error(tries.errors), tries)

    def _failed(self, target: Target, e: AttemptFailed, bp: BodyPrint, tries: _Tries) -> GatewayError | None:
        """Account one failed attempt; the error to raise now, or None to try the next candidate."""
        if e.leg is not None:  # a PD pool: the prefill leg failed (its own breaker has it), or this decode server
            target.breaker.release()  # has no KV headroom; not this replica's health: try the next pair
            target.state.last_error = e.message
            self.metrics.upstream_errors.labels(target.pool, target.name, f"{e.leg}_leg").inc()
            return None
        cause = classify(e)
        kind = ("stalled" if e.stalled else "timeout" if e.timeout else "connect" if e.connect
                else "credentials" if cause is Cause.CREDENTIALS else f"http_{e.status}" if e.status else "protocol")
        self.metrics.upstream_errors.labels(target.pool, target.name, kind).inc()
        if cause is Cause.REQUEST:
            target.breaker.success()  # the replica answered properly; the request was bad
            self._release_suspects(tries)
            self.metrics.request_caused_failures.labels(target.pool).inc()
            return client_error(e)
        if cause is Cause.CREDENTIALS:
            target.breaker.release()  # a config problem, not the replica's health: no verdict
            tries.bad_pools.add(target.pool)
            self._log_credentials(target, e)
            return None
        target.state.last_error = e.message
        if cause is Cause.REPLICA:
            target.breaker.failure(None)
            if e.connect:
                self.on_unreachable(target)  # the health checker owns `healthy`
            return None
        if cause is Cause.HANG:
            tries.hangs += 1
            if e.stalled:
                pass  # an ejected replica's breaker is already open
            elif e.replica_answered:
                target.breaker.release()  # it served others while this one waited: about this request, not the replica
            else:
                target.breaker.failure(bp.key, tries.tenant)
            if tries.hangs >= 2:
                return self._quarantine(bp, tries)
            return None
        # SUSPECT_5XX: the replica or the body; a second replica decides
        window = self.cfg.retry.content_evidence_s
        if tries.suspect_5xx and all(t.breaker.answered_within(window) for t in [*tries.suspect_5xx, target]):
            replicas = len(tries.suspect_5xx) + 1
            target.breaker.release()
            self._release_suspects(tries)
            self.metrics.request_caused_failures.labels(target.pool).inc()
            return content_error(e, replicas)
        target.breaker.release()
        tries.suspect_5xx.append(target)
        return None

    @staticmethod
    def _release_suspects(tries: _Tries) -> None:
        tries.suspect_5xx.clear()  # their breakers' slots were released when they failed; no verdict now

    def _quarantine(self, bp: BodyPrint, tries: _Tries) -> GatewayError:
        """The body timed out or broke the connection on two replicas: refused for the TTL from now on (422); this
        request gets the timeout/upstream error it met, saying so (x-should-retry false)."""
        self.metrics.poison_quarantined.inc()
        log.warning("quarantined a request body for %.0f s: it timed out or broke the connection on %d replicas "
                    "(fingerprint %s)", self.quarantine.ttl_s, tries.hangs, bp.key)
        self.quarantine.add_soon(bp)  # the local mirror at once, the shared set in the background
        err = final_error(tries.errors)
        err.message += (f" It timed out or broke the connection on {tries.hangs} replicas, so the same request body "
                        f"is now refused for {self.quarantine.ttl_s:.0f} s; change it (e.g. smaller n, max_tokens or "
                        "prompt) rather than retrying.")
        err.should_retry = False
        err.retry_after = None
        return err

    def _log_credentials(self, target: Target, e: AttemptFailed) -> None:
        now = time.monotonic()
        if now - self._creds_logged.get(target.pool, float("-inf")) >= 60.0:  # one line a minute per pool for on-call
            self._creds_logged[target.pool] = now
            log.error("upstream rejected the gateway's credentials for pool %s (replica %s, HTTP %s: %s): check the "
                      "pool's api_key_env", target.pool, target.name, e.status, e.message)

    @staticmethod
    def _tag(err: GatewayError, tries: _Tries) -> GatewayError:
        err.attempts = tries.count
        err.target = tries.last
        if tries.count:
            err.extra_headers = {**err.extra_headers, "x-gateway-attempts": str(tries.count)}
        if tries.last is not None:  # who answered (or was last tried), as on a served response
            err.extra_headers = {**err.extra_headers, "x-gateway-pool": tries.last.pool,
                                 "x-gateway-replica": tries.last.name}
        return err

    def _ejected(self, target: Target, overdue: int) -> None:
        target.breaker.trip("stalled")
        self.metrics.ejections.labels(target.pool, target.name, "stalled").inc()
        self.metrics.breaker_open.labels(target.pool, target.name).set(1)
        log_event("ejection", pool=target.pool, replica=target.name, reason="stalled", overdue_requests=overdue,
                  silent_s=self.stalls.stall_s)

    # -- one attempt -----------------------------------------------------------------------------------------
    async def _attempt(self, target: Target, call: UpstreamCall, attempt: Attempt, bp: BodyPrint, n: int,
                       parent: Any) -> Opened:
        span = self._start_span(target, call, n, parent)
        w: Waiting = self.stalls.begin(target, bp, call.stream, getattr(attempt, "ttft", 0.0))
        try:
            async with w.timeout:
                opened = await self.backends[target.kind].open(target, call)
        except TimeoutError:  # only the stall detector's cut (the backend maps its own timeouts)
            e = AttemptFailed(f"replica {target.name} stopped answering (ejected)", timeout=True,
                              stalled=True)
            self._end_span(span, e)
            raise e from None
        except AttemptFailed as e:
            if e.status is not None:
                self.stalls.answered(target)
            elif e.timeout:
                e.replica_answered = self.stalls.answered_since(target, w.started)
            self._end_span(span, e)
            raise
        except BaseException:
            if span is not None:
                span.set_attribute("error.type", "cancelled")
                span.end()
            raise
        finally:
            self.stalls.end(w)
        self.stalls.answered(target)
        if span is not None:
            span.set_attribute("http.response.status_code", 200)
            close = opened.close

            async def close_and_end() -> None:  # the span covers the upstream exchange until it is closed
                try:
                    await close()
                finally:
                    span.end()

            opened.close = close_and_end
        return opened

    def _start_span(self, target: Target, call: UpstreamCall, n: int, parent: Any) -> Any:
        if self.tracer is None:
            return None
        ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        u = urlsplit(target.url(call.endpoint))
        span = self.tracer.start_span(
            f"POST {target.name}", kind=SpanKind.CLIENT, context=ctx,
            attributes={"server.address": u.hostname or "", "server.port": u.port or (443 if u.scheme == "https" else 80),
                        "url.path": u.path,
                        "gateway.pool": target.pool, "gateway.replica": target.name, "gateway.attempt": n,
                        "gen_ai.request.model": target.upstream_model, "http.request.method": "POST"})
        propagate.inject(call.headers, context=trace.set_span_in_context(span))
        return span

    @staticmethod
    def _end_span(span: Any, e: AttemptFailed) -> None:
        if span is None:
            return
        if e.status is not None:
            span.set_attribute("http.response.status_code", e.status)
        kind = "stalled" if e.stalled else "timeout" if e.timeout else "connect" if e.connect \
            else str(e.status) if e.status else "protocol"
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, e.message[:200]))
        span.end()
