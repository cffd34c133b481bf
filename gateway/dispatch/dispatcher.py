"""Dispatch: try the decision's ranked targets in order until one answers, before anything reached the client.

Per target: the circuit breaker must grant a slot; the backend opens the attempt (retrying a dropped pooled
connection on the same replica); success/failure feeds the breaker; a refused connection also marks the
replica unhealthy until the next health check says otherwise. Bounded by max_attempts and the total deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.backends.base import AttemptFailed, Backend, Opened, UpstreamCall
from gateway.config import GatewayConfig
from gateway.tenancy.policy_schema import Tenant
from gateway.dispatch.feedback import Attempt, Feedback
from gateway.dispatch.upstream_body import adapt_body
from gateway.dispatch.retry_policy import client_error, final_error, is_fatal
from gateway.errors import NoCapacity, UpstreamTimeout
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.upstreams import Target


@dataclass
class Dispatched:
    target: Target
    opened: Opened
    attempts: int
    attempt: Attempt


class Dispatcher:
    def __init__(self, cfg: GatewayConfig, backends: dict[str, Backend], metrics: GatewayMetrics, feedback: Feedback) -> None:
        self.cfg = cfg
        self.backends = backends
        self.metrics = metrics
        self.feedback = feedback

    async def open(self, decision: Decision, req: RoutingRequest, body: dict[str, Any], deadline: float,
                   tenant: Tenant | None = None) -> Dispatched:
        endpoint, stream, request_id = req.endpoint, req.stream, req.request_id
        errors: list[AttemptFailed] = []
        attempts = 0
        for target in decision.ranked:
            if attempts >= self.cfg.retry.max_attempts:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UpstreamTimeout("The request's total time budget ran out before an upstream answered.", should_retry=False)
            if not target.breaker.acquire():
                continue
            attempts += 1
            if attempts > 1:
                self.metrics.retries.labels(target.pool).inc()
            call = UpstreamCall(endpoint, adapt_body(body, target, stream, tenant), stream, request_id,
                                min(self.cfg.timeouts.first_byte, remaining))
            attempt = Attempt(req, target, decision)
            try:
                await self.feedback.dispatched(attempt)
                opened = await self.backends[target.kind].open(target, call)
            except AttemptFailed as e:
                self.feedback.finished(attempt, failed=True)
                if is_fatal(e):
                    target.breaker.success()  # the replica answered properly; the request was bad
                    raise client_error(e) from None
                target.breaker.failure()
                target.last_error = e.message
                if e.connect:
                    target.healthy = False
                kind = "timeout" if e.timeout else "connect" if e.connect else f"http_{e.status}" if e.status else "protocol"
                self.metrics.upstream_errors.labels(target.pool, target.name, kind).inc()
                errors.append(e)
                continue
            except BaseException:
                self.feedback.finished(attempt, failed=True)
                target.breaker.release()  # cancelled (client gone): no verdict on the replica
                raise
            target.breaker.success()
            return Dispatched(target, opened, attempts, attempt)
        if not errors:
            raise NoCapacity("No replica can take this request right now.", retry_after=1)
        raise final_error(errors)
