"""The request path shared by /v1/chat/completions and /v1/completions: identify -> parse -> decide ->
dispatch -> respond (JSON, or SSE relayed chunk by chunk) -> account (metrics, one log line, one span)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.error_handlers import to_response
from gateway.asgi import EventStreamResponse, run_until_disconnect
from gateway.backends.openai_compat import StreamBroken
from gateway.config import ModelRoute, PerTokenPricing
from gateway.dispatch.dispatcher import Dispatched
from gateway.errors import (GatewayError, ModelNotFound, NoCapacity, PermissionDenied, QuotaExceeded, RateLimited,
                            RequestTooLarge)
from gateway.prefix.hashing import group_key, prefix_hashes
from gateway.observability.logging import log_request
from gateway.prediction.pricing import request_cost
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.api.openai.body import read_body
from gateway.api.openai.validation import ParsedRequest, parse_json, validate
from gateway.state import AppState
from gateway.tenancy.budget import Refusal, Reservation, Usage, budget_caps
from gateway.tenancy.policy_schema import Tenant
from gateway.tenancy.ratelimit import Bucket, buckets_for

log = logging.getLogger("gateway.proxy")

DONE = b"data: [DONE]\n\n"


def sse_error(message: str, type_: str = "server_error", code: str = "upstream_error") -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}) + b"\n\n"


def abandoned_usage(ex: Exchange, predicted_cached: int) -> dict[str, Any]:
    """A client that leaves mid-stream never gets the engine's usage chunk, yet the engine prefilled its prompt and
    generated until the cancel. Charge what the gateway knows: its own prompt count, the cache hit it predicted,
    and one token per content chunk relayed (a lower bound: an engine chunk carries >= 1 token)."""
    return {"prompt_tokens": ex.parsed.prompt_tokens, "completion_tokens": max(ex.chunks - 1, 0),  # minus the role chunk
            "prompt_tokens_details": {"cached_tokens": predicted_cached}}


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int | None, int]:
    """(prompt, cached — None when the engine does not report it, completion) from an OpenAI usage object."""
    u = usage or {}
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(u.get("prompt_tokens") or 0), cached if isinstance(cached, int) else None, int(u.get("completion_tokens") or 0)


@dataclass
class Exchange:
    """One client request's bookkeeping from arrival to the last byte."""

    request_id: str
    tenant: Tenant
    endpoint: str
    parsed: ParsedRequest
    route: ModelRoute
    started: float
    deadline: float
    decision: Decision | None = None
    rreq: RoutingRequest | None = None
    dispatched: Dispatched | None = None
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    status: str = "200"
    error: str | None = None
    chunks: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    span: Any = None
    buckets: list[Bucket] = field(default_factory=list)  # rate-limit buckets this request was admitted on
    reservation: Reservation | None = None  # budget held until the usage is known


@dataclass(frozen=True)
class RecentDecision:
    at: float
    request_id: str
    tenant: str
    model: str
    status: str
    served_by: str | None
    attempts: int
    decision: Decision | None

    def explain(self) -> dict[str, Any]:
        return {"at": self.at, "request_id": self.request_id, "tenant": self.tenant, "model": self.model,
                "status": self.status, "served_by": self.served_by, "attempts": self.attempts,
                "decision": self.decision.explain() if self.decision else None}


class OpenAIProxy:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self._model_swap: dict[tuple[str, str], tuple[bytes, bytes, bytes, bytes]] = {}
        self._tenant_inflight: dict[str, int] = {}
        self._routes: dict[tuple[str, str, str, float, str | None], ModelRoute] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.recent: deque[RecentDecision] = deque(maxlen=500)  # for the admin API (no prompt bodies kept)

    # -- entry -----------------------------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        st = self.state
        started = time.monotonic()
        request_id = request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex
        tenant = st.control.effective(st.policies.index.identify(request.headers.get("authorization")))
        raw = await read_body(request, st.config.max_body_bytes)
        parsed = validate(parse_json(raw), endpoint)
        route = self._route_for(tenant, parsed.model)
        pin = request.headers.get("x-gateway-pool")
        if pin is not None and pin not in route.pools:
            raise PermissionDenied("This key may not pin requests to that pool.", param="x-gateway-pool")
        if pin is not None:
            route = ModelRoute(name=route.name, pools=[pin])
        cap = tenant.max_concurrent
        if cap is not None and self._tenant_inflight.get(tenant.name, 0) >= cap:
            raise RateLimited(f"Too many concurrent requests for this key (limit {cap}).", retry_after=1)
        ex = Exchange(request_id, tenant, endpoint, parsed, route, started, started + st.config.timeouts.total)
        await self._admit(ex)
        ex.span = st.tracer.start_span(
            f"{'chat' if endpoint == 'chat/completions' else 'text_completion'} {parsed.model}",
            attributes={"gen_ai.operation.name": "chat" if endpoint == "chat/completions" else "text_completion",
                        "gen_ai.request.model": parsed.model, "gateway.tenant": tenant.name,
                        "gateway.request_id": request_id, "gen_ai.request.max_tokens": parsed.max_output_tokens or 0},
        )
        ex.rreq = self._routing_request(ex)
        ex.decision = await st.router.decide(ex.rreq, route)
        st.metrics.decisions.labels(parsed.model, ex.decision.branch).inc()
        try:
            if ex.decision.branch == "shed":
                retry = float(ex.decision.inputs.get("retry_after_s", 1.0))
                raise NoCapacity("No replica can meet this key's TTFT target right now; retry shortly.", retry_after=retry)
            await self._reserve(ex)
        except GatewayError as e:  # refused before dispatch: nothing was used, so the rate allowance is given back
            ex.span.end()
            st.metrics.requests.labels(parsed.model, "none", tenant.name, str(e.status)).inc()
            for b in ex.buckets:
                self._background(st.limiter.adjust(b, b.cost))
            raise
        ex.headers.update({"x-request-id": request_id, "x-gateway-route": ex.decision.branch})
        # from here on `_finish` runs exactly once (on_close for streams, finally below), and gives this back
        self._tenant_inflight[tenant.name] = self._tenant_inflight.get(tenant.name, 0) + 1
        if parsed.stream:
            return EventStreamResponse(lambda: self._stream_first(ex), lambda: self._stream_rest(ex), ex.headers,
                                       on_close=lambda disconnected: self._finish(ex, disconnected))
        disconnected = True
        try:
            disconnected, resp = await run_until_disconnect(request.receive, self._non_stream(ex))
        except GatewayError as e:
            disconnected = False
            ex.status, ex.error = str(e.status), e.message
            raise
        finally:
            await self._finish(ex, disconnected)
        return resp if not disconnected else Response(status_code=499)

    def _routing_request(self, ex: Exchange) -> RoutingRequest:
        r = self.state.config.routing
        t = ex.tenant
        salt = t.cache_namespace(ex.parsed.body.get("cache_salt"))
        hashes = tuple(prefix_hashes(ex.endpoint, ex.parsed.body, ex.route.name, salt, r.chunk_tokens)) \
            if r.policy == "prefix_sla_cost" else ()
        group = group_key(hashes, hash(ex.request_id))
        return RoutingRequest(
            ex.request_id, t.name, ex.parsed.model, ex.endpoint, ex.parsed.stream, ex.parsed.prompt_tokens,
            ex.parsed.max_output_tokens, hashes, (t.ttft_sla_ms or r.ttft_sla_ms) / 1000.0, t.objective or r.objective,
            t.on_sla_miss or r.on_sla_miss, group,
        )

    def _route_for(self, tenant: Tenant, model: str) -> ModelRoute:
        """The pools this tenant may be served from for this model, in fallback order: the model's pools it may
        use, then its own fallback pools; or only the pool on-call pinned it to. Memoized per policy/control
        version. A model the tenant may not use is reported exactly like one that does not exist: nothing leaks."""
        st = self.state
        pin = st.control.pinned_pool(tenant.name)  # in the key: a pin lapses by time, with no state change
        key = (tenant.name, model, st.policies.current.fingerprint, st.control.applied_at, pin)
        route = self._routes.get(key)
        if route is not None:
            return route
        if model in tenant.models:
            r = next((r for r in st.config.models if r.name == model), None)
            pools = [pin] if pin is not None else \
                [p for p in r.pools if self._pool_allowed(tenant, p)] + \
                [p for p in tenant.fallback_pools if p not in r.pools and self._pool_allowed(tenant, p)] if r else []
            if r is not None and pools:
                if len(self._routes) > 10_000:
                    self._routes.clear()
                route = self._routes[key] = ModelRoute(name=model, pools=pools)
                return route
        raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")

    def _pool_allowed(self, tenant: Tenant, pool: str) -> bool:
        if tenant.pools is not None and pool not in tenant.pools and pool not in tenant.fallback_pools:
            return False
        cap = tenant.max_price_per_mtok
        head = self.state.registry.head(pool)
        price = head.pricing if head else None
        return cap is None or not isinstance(price, PerTokenPricing) or max(price.input_per_mtok, price.output_per_mtok) <= cap

    # -- limits and budgets ----------------------------------------------------------------------------------
    def _expected_output(self, ex: Exchange, pool: str) -> int:
        n = ex.parsed.body.get("n")
        choices = n if isinstance(n, int) and n > 1 else 1
        if ex.parsed.max_output_tokens is not None:
            return ex.parsed.max_output_tokens * choices
        head = self.state.registry.head(pool)
        return (head.timing.expected_output_tokens if head else 1000) * choices

    async def _admit(self, ex: Exchange) -> None:
        """Requests/min and tokens/min (estimated: prompt + expected output), across every instance."""
        rl = ex.tenant.rate_limits
        if rl.requests_per_minute is None and rl.tokens_per_minute is None:
            return
        buckets = buckets_for(ex.tenant, ex.parsed.prompt_tokens + self._expected_output(ex, ex.route.pools[0]))
        if not buckets:
            return
        adm = await self.state.limiter.take(buckets)
        headers = {}
        for b, left in zip(buckets, adm.remaining):
            kind = "requests" if b.key.endswith(":req") else "tokens"
            headers[f"x-ratelimit-limit-{kind}"] = str(b.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(left)))
        if not adm.allowed:
            self.state.metrics.refusals.labels(ex.tenant.name, "rate_limit").inc()
            err = RateLimited("Rate limit reached for this key; retry after the time in Retry-After.",
                              retry_after=max(adm.retry_after_s, 0.001))
            err.extra_headers = headers
            raise err
        ex.buckets = buckets
        ex.headers.update(headers)

    async def _reserve(self, ex: Exchange) -> None:
        """Hold the request's worst-case cost (dearest pool it may use, no cache hit, max output) against the
        tenant's budgets; settled with the real cost in `_finish`. Every request gets a reservation, so usage per
        tenant is recorded even without a cap (the worst case is only priced when there is one)."""
        worst = 0.0
        if budget_caps(ex.tenant):
            for pool in ex.route.pools:
                head = self.state.registry.head(pool)
                if head is not None:
                    worst = max(worst, request_cost(head.pricing, ex.parsed.prompt_tokens, 0, self._expected_output(ex, pool)))
        got = await self.state.budget.reserve(ex.tenant, ex.request_id, worst, self.state.config.timeouts.total + 60)
        if isinstance(got, Refusal):
            self.state.metrics.refusals.labels(ex.tenant.name, "budget").inc()
            err = QuotaExceeded(f"This key's {'daily' if got.period == 'day' else 'monthly'} budget of ${got.limit:.2f} "
                                f"is spent (or held by requests in flight).", should_retry=False)
            err.extra_headers = {"retry-after": str(_seconds_to_reset(got.period))}
            raise err
        ex.reservation = got

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Settlements run after the response; kept referenced until done, awaited at shutdown (`drain`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("settlement failed: %s", type(task.exception()).__name__)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- non-streaming ---------------------------------------------------------------------------------------
    async def _non_stream(self, ex: Exchange) -> Response:
        assert ex.decision is not None
        assert ex.rreq is not None
        d = await self.state.dispatcher.open(ex.decision, ex.rreq, ex.parsed.body, ex.deadline, ex.tenant)
        ex.dispatched = d
        ex.first_token_at = time.monotonic()
        self.state.feedback.first_token(d.attempt, None)  # the whole response: not a TTFT observation
        body = d.opened.body or {}
        ex.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        body["model"] = ex.parsed.model
        self._target_headers(ex)
        ex.headers["x-gateway-cost-usd"] = f"{self._cost(ex):.8f}"
        return Response(orjson.dumps(body), media_type="application/json", headers=ex.headers)

    # -- streaming -------------------------------------------------------------------------------------------
    async def _stream_first(self, ex: Exchange) -> Response | bytes:
        assert ex.decision is not None
        assert ex.rreq is not None
        try:
            d = await self.state.dispatcher.open(ex.decision, ex.rreq, ex.parsed.body, ex.deadline, ex.tenant)
        except GatewayError as e:  # before the commit point: a real HTTP error the SDK can act on
            ex.status, ex.error = str(e.status), e.message
            return to_response(e)  # x-request-id is added by RequestIdMiddleware like on every response
        ex.dispatched = d
        ex.first_token_at = time.monotonic()
        self.state.feedback.first_token(d.attempt, ex.first_token_at - ex.started)
        self._target_headers(ex)
        out = self._relay(ex, d.opened.first or b"")
        return out or b": stream open\n\n"

    async def _stream_rest(self, ex: Exchange) -> Any:
        d = ex.dispatched
        assert d is not None and d.opened.rest is not None
        saw_done = False
        try:
            async for payload in d.opened.rest:
                if payload == b"[DONE]":
                    saw_done = True
                    yield DONE
                    break
                if payload.startswith(b'{"error"'):
                    ex.status, ex.error = "stream_error", "upstream error event"
                    yield self._rewrap_error(payload)
                    return
                out = self._relay(ex, payload)
                if out:
                    yield out
        except StreamBroken as e:
            ex.status, ex.error = "stream_error", str(e)
            yield sse_error(f"The upstream replica failed mid-stream: {e}")
            return
        if not saw_done:
            ex.status, ex.error = "stream_error", "upstream closed the stream before [DONE]"
            yield sse_error("The upstream replica closed the stream before it was complete.")

    def _relay(self, ex: Exchange, payload: bytes) -> bytes | None:
        """One upstream payload as the client should see it: the client's model name; the usage chunk kept for
        metering and shown only if the client asked for it."""
        ex.chunks += 1
        if b'"choices":[]' in payload and b'"usage"' in payload:
            try:
                usage = orjson.loads(payload).get("usage")
                if isinstance(usage, dict):
                    ex.usage = usage
            except orjson.JSONDecodeError:
                pass
            if not ex.parsed.include_usage:
                return None
        old, new, old2, new2 = self._swap(ex)
        if old != new:
            payload = payload.replace(old, new, 1).replace(old2, new2, 1)
        return b"data: " + payload + b"\n\n"

    def _swap(self, ex: Exchange) -> tuple[bytes, bytes, bytes, bytes]:
        assert ex.dispatched is not None
        key = (ex.dispatched.target.upstream_model, ex.parsed.model)
        s = self._model_swap.get(key)
        if s is None:
            up, client = orjson.dumps(key[0]), orjson.dumps(key[1])
            s = (b'"model":' + up, b'"model":' + client, b'"model": ' + up, b'"model": ' + client)
            self._model_swap[key] = s
        return s

    @staticmethod
    def _rewrap_error(payload: bytes) -> bytes:
        try:
            err = orjson.loads(payload).get("error") or {}
        except (orjson.JSONDecodeError, AttributeError):
            err = {}
        code = err.get("code") if isinstance(err, dict) else None
        overloaded = code in (503, 429, "503")
        return sse_error(str((err or {}).get("message", "upstream error")),
                         "service_unavailable_error" if overloaded else "server_error",
                         "server_is_overloaded" if overloaded else "upstream_error")

    # -- accounting ------------------------------------------------------------------------------------------
    def _target_headers(self, ex: Exchange) -> None:
        d = ex.dispatched
        assert d is not None
        ex.headers["x-gateway-pool"] = d.target.pool
        ex.headers["x-gateway-replica"] = d.target.name
        ex.headers["x-gateway-attempts"] = str(d.attempts)

    def _cost(self, ex: Exchange) -> float:
        if ex.dispatched is None:
            return 0.0
        prompt, cached, completion = usage_counts(ex.usage)
        return request_cost(ex.dispatched.target.pricing, prompt, cached or 0, completion)

    async def _finish(self, ex: Exchange, disconnected: bool) -> None:
        st = self.state
        now = time.monotonic()
        self._tenant_inflight[ex.tenant.name] -= 1
        if disconnected and ex.status == "200":
            ex.status = "client_disconnect"
        d = ex.dispatched
        if d is not None:
            try:
                await d.opened.close()  # for a client that left mid-stream this cancels the upstream request
            except Exception:  # noqa: BLE001 - closing a broken upstream connection can fail; nothing to do
                pass
            if ex.usage is not None:
                st.feedback.usage(d.attempt, usage_counts(ex.usage)[1])
            st.feedback.finished(d.attempt, failed=ex.status not in ("200", "client_disconnect"))
            if ex.usage is None and ex.status == "client_disconnect" and ex.first_token_at is not None:
                ex.usage = abandoned_usage(ex, d.attempt.predicted_cached)
        pool = d.target.pool if d else "none"
        model, tenant = ex.parsed.model, ex.tenant.name
        m = st.metrics
        m.requests.labels(model, pool, tenant, ex.status).inc()
        m.latency.labels(model, pool, tenant).observe(now - ex.started)
        if ex.first_token_at is not None:
            m.ttft.labels(model, pool, tenant).observe(ex.first_token_at - ex.started)
        prompt, reported_cached, completion = usage_counts(ex.usage)
        cached = reported_cached or 0
        cost = self._cost(ex)
        if ex.usage:
            m.tokens.labels(model, pool, tenant, "prompt").inc(prompt)
            m.tokens.labels(model, pool, tenant, "cached").inc(cached)
            m.tokens.labels(model, pool, tenant, "completion").inc(completion)
            m.cost.labels(model, pool, tenant).inc(cost)
        used = Usage(cost, prompt, cached, completion) if ex.usage else None
        if ex.reservation is not None:
            self._background(st.budget.settle(ex.reservation, used))
        for b in ex.buckets:
            if b.key.endswith(":tok") and b.cost != (prompt + completion if used else 0):
                self._background(st.limiter.adjust(b, b.cost - (prompt + completion if used else 0)))
        self.recent.append(RecentDecision(time.time(), ex.request_id, tenant, model, ex.status,
                                          d.target.name if d else None, d.attempts if d else 0, ex.decision))
        if ex.span is not None:
            ex.span.set_attributes({
                "gen_ai.response.model": ex.parsed.model,
                "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": completion,
                "gateway.cached_tokens": cached,
                "gateway.pool": pool,
                "gateway.replica": d.target.name if d else "",
                "gateway.route": ex.decision.branch if ex.decision else "",
                "gateway.status": ex.status,
            })
            ex.span.end()
        if st.config.observability.log_requests:
            log_request({
                "request_id": ex.request_id, "tenant": tenant, "model": model, "endpoint": ex.endpoint,
                "stream": ex.parsed.stream, "status": ex.status, "pool": pool, "replica": d.target.name if d else None,
                "route": ex.decision.branch if ex.decision else None, "attempts": d.attempts if d else 0,
                "ttft_ms": round((ex.first_token_at - ex.started) * 1000, 1) if ex.first_token_at else None,
                "duration_ms": round((now - ex.started) * 1000, 1), "prompt_tokens": prompt,
                "cached_tokens": cached, "completion_tokens": completion, "cost_usd": round(cost, 8),
                "error": ex.error,
            })


def _seconds_to_reset(period: str) -> int:
    """Seconds until the budget period ends (UTC midnight / the first of next month)."""
    from datetime import datetime, timedelta, timezone

    now = datetime.now(timezone.utc)
    if period == "day":
        end = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        end = (now.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((end - now).total_seconds()))
