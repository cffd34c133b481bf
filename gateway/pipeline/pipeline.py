"""The one request path of every API (chat, completions, Responses bridged and native, Messages), as a list of
stages, each its own module:

    identify key -> tenant               tenancy/ (401)
    admission: concurrency slot          admission.py  (429; synchronous: before the first await)
    read body -> JSON -> validate        body.py, validation.py  (413, 400)
    entitlements: model -> pools, pin    entitlements.py  (404, 403)
    admission: fleet slot, rate limits   admission.py  (429)
    flow control: fair queue, bands      flow.py  (429/503 with a reason; off unless flow.enabled)
    the request's span (tracing on)      telemetry.py
    decide: routing request -> Decision  decide.py  (503 when shed)
    budget: reserve the worst case       budget.py  (429 insufficient_quota)
    relay: dispatch, JSON or SSE         relay.py
    accounting: release, meter, log      accounting.py  (exactly once, whatever happened before)

Every request, refused or served, is counted in `gateway_requests_total{status,reason}` and logged once.

Each stage takes the parts of the app it uses and typed inputs, and returns a value (a slot, what admission took,
how flow control let the request pass, a decision, a reservation); only this orchestrator writes them into the
request's record (`Exchange`), which is complete once `admit` returns. The relay writes the request's `Outcome`
(outcome.py: who answered, when, the usage, status and reason) as the answer arrives; accounting reads the exchange
and the outcome together, at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.asgi import EventStreamResponse, LiveStreams, run_until_disconnect
from gateway.config import ModelRoute
from gateway.errors import GatewayError
from gateway.pipeline import admission, budget, decide, flow, idempotency
from gateway.pipeline.accounting import Accounting, Books
from gateway.pipeline.body import read_body
from gateway.pipeline.call import PLAIN, Call
from gateway.pipeline.entitlements import Entitlements
from gateway.pipeline.exchange import Exchange, RecentDecision
from gateway.pipeline.front import Hashing, Names, prepare
from gateway.pipeline.outcome import Outcome
from gateway.pipeline.refusal import Edge, reason_for
from gateway.pipeline.relay import Relay, cut_by_shutdown, stalled
from gateway.pipeline.telemetry import start_span
from gateway.pipeline.validation import check_limits, limits_for, refuse_images, validate
from gateway.policy_schema import Tenant
from gateway.prefix.hashing import prefix_hashes
from gateway.routing import registry
from gateway.routing.request import RoutingRequest
from gateway.state import AppState
from gateway.tenancy.concurrency import Slot

__all__ = ["Exchange", "Outcome", "Pipeline", "RecentDecision"]

log = logging.getLogger("gateway.proxy")


class Pipeline:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.entitlements = Entitlements(state.config.models, state.registry, state.policies, state.control)
        self.relay = Relay(state.dispatcher, state.feedback, state.control, state.config, state.registry)
        self.recent: deque[RecentDecision] = deque(maxlen=500)  # for the admin API (no prompt bodies kept)
        books = Books(state.metrics, state.feedback, state.concurrency, state.budget, state.limiter, state.idempotency,
                      state.recorder, frozenset(m.name for m in state.config.models),
                      state.config.observability.log_requests)
        self.accounting = Accounting(books, self.recent, self._background)
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: dict[str, Any] = {}  # tenant -> its gateway_inflight_requests child (labels() costs ~1.5 us)
        self.live = LiveStreams()  # streams in flight: a shutdown past its drain timeout cuts them (serve.py)

    # -- public entry points (the admin API's explain resolves exactly like a request) -------------------------------
    def route_for(self, tenant: Tenant, model: str) -> ModelRoute:
        return self.entitlements.route_for(tenant, model)

    def routing_request(self, ex: Exchange) -> RoutingRequest:
        """The request as the router sees it, hashed exactly as live traffic is (the admin explain's dry run):
        in precise/hybrid mode the prefix keys are the engines' token-page keys, not the text-chunk hashes."""
        st = self.state
        return decide.routing_request(st.config.routing, ex.id, ex.tenant, ex.endpoint, ex.parsed, ex.route.name, ex.call,
                                      st.prefix_hasher)

    # -- entry -----------------------------------------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str, body: dict[str, Any] | None = None,
                     call: Call = PLAIN) -> Response:
        """`body`: an already-parsed OpenAI body (the Responses/Messages adapters); the request's own body is then
        not read. `call`: what the adapter knows besides the body (pipeline/call.py). Returns a JSON Response, or an
        EventStreamResponse whose `on_close` runs the accounting — call it (with a translating `send` if need be)
        or the request is never accounted."""
        ex = await self.begin(request, endpoint, body, call)
        if isinstance(ex, Response):
            return ex
        return await self._serve(request, ex)

    async def begin(self, request: Request, endpoint: str, body: dict[str, Any] | None, call: Call,
                    pools: Callable[[ModelRoute], ModelRoute] | None = None) -> Exchange | Response:
        """The stages every API shares up to the exchange: key -> tenant (401), concurrency slot (429), body (413,
        408, 400), entitlements (404, 403; `pools` narrows the route: the native Responses path keeps the pools that
        serve /v1/responses), limits. A refusal is accounted here and raised; a client gone while sending its body
        is a 499. From the exchange on, accounting.finish runs exactly once."""
        st = self.state
        request.scope.setdefault("state", {})["accounted"] = True  # every outcome below is accounted here
        edge = Edge(request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex, endpoint, time.monotonic(),
                    call=call)
        slot: Slot | None = None
        try:
            tenant = st.control.effective(st.policies.index.identify(request.headers.get("authorization")))
            edge.tenant, edge.stage = tenant.name, "concurrency"
            # before the first await: check and take are one
            slot = admission.take_slot(st.concurrency, st.metrics, tenant, edge.request_id)
            ex = await self._exchange(request, endpoint, body, tenant, edge, pools)
        except BaseException as e:
            if slot is not None:
                st.concurrency.release(slot)
            self.accounting.rejected(edge, e)
            if isinstance(e, ClientDisconnect):  # left while sending its body: nobody to answer, nothing to report
                return Response(status_code=499)
            raise
        ex.slot = slot
        gauge = self._inflight.get(tenant.name)
        if gauge is None:
            gauge = self._inflight[tenant.name] = st.metrics.inflight.labels(tenant.name)
        gauge.inc()
        return ex

    async def _exchange(self, request: Request, endpoint: str, body: dict[str, Any] | None, tenant: Tenant,
                        edge: Edge, pools: Callable[[ModelRoute], ModelRoute] | None) -> Exchange:
        st = self.state
        body_bytes = edge.call.body_bytes  # an adapter's parsed body: the size of the client's
        front = edge.call.front  # an adapter's front half of its translated body (front.py), if it ran one
        if body is None:
            edge.stage = "read_body"
            raw = await read_body(request, st.config.body_limit(endpoint), st.config.timeouts.body_read)
            edge.stage = "parse"
            body_bytes = len(raw)
            # parse, validate, render, hash: one function, in a worker process for a large body (offload.py)
            front = await st.cpu.front(raw, st.config.max_json_depth, prepare, endpoint,
                                       self.hashing(tenant, body_bytes))
            edge.call = replace(edge.call, front=front)
        edge.stage = "validate"
        if front is not None:
            edge.model, edge.stream = self.accounting.model_label(front.model), front.stream
            parsed = front.validated()
        else:
            assert body is not None
            edge.model = self.accounting.model_label(body.get("model"))
            edge.stream = body.get("stream") is True
            parsed = await st.cpu.run(body_bytes, validate, body, endpoint)
        edge.stage = "entitlements"
        route = self.entitlements.resolve(tenant, parsed.model, request.headers.get("x-gateway-pool"))
        if pools is not None:
            route = pools(route)
        parsed = self.entitlements.with_alias_defaults(tenant, parsed)
        edge.model = route.name  # an alias's served model
        edge.stage = "validate"
        if not route.vision:
            refuse_images(parsed.body, route.name, front.image_at if front is not None else "")
        check_limits(parsed, endpoint, limits_for(st.config, route.pools, st.registry))  # n and context caps of these pools
        return Exchange(edge.request_id, tenant, endpoint, parsed, route, edge.started,
                        edge.started + st.config.timeouts.total, headers={"x-request-id": edge.request_id}, call=edge.call,
                        flow_band=request.headers.get("x-gateway-band"), body_bytes=body_bytes)

    def hashing(self, tenant: Tenant, size: int) -> Hashing | None:
        """What the front half needs to hash a prompt as the decide stage would (front.py), as plain data, for a body
        of `size` bytes (with any stored turn it continues). None for a small body: hashing ahead pays only off the
        event loop, and the decide stage hashes it after admission, so a refused request is never hashed; None too
        when that stage hashes no text chunks (a policy without prefixes, or precise/hybrid mode's token-page keys)."""
        st, r = self.state, self.state.config.routing
        if not st.cpu.large(size) or st.prefix_hasher is not prefix_hashes or \
                not registry.spec(r.policy.type).uses_prefix:
            return None
        return Hashing(Names.of(tenant), r.chunk_tokens)

    async def admit(self, ex: Exchange, decided: Callable[[Exchange], None] | None = None) -> None:
        """The stages before dispatch — fleet slot, rate limits, span, routing decision (then `decided`, the native
        Responses path's hook), budget; the exchange is complete when it returns. A refusal gives the rate allowance
        back (nothing was used), is accounted with its outcome (it never reached the relay), and is raised to the
        caller."""
        st = self.state
        stage = "concurrency"
        try:
            await admission.take_fleet_slot(st.concurrency, st.metrics, ex.tenant, ex.slot)
            stage = "rate_limit"
            first_pool = ex.route.pools[0]
            expected = budget.expected_output(st.registry, ex.parsed, first_pool)
            admitted = await admission.admit_rate(st.limiter, st.metrics, ex.tenant, ex.parsed.prompt_tokens + expected)
            ex.buckets = admitted.buckets
            ex.headers.update(admitted.headers)
            stage = "flow"
            rreq, held = None, None
            if st.flow is not None:
                rreq = await self._routing(ex)
                passed = await flow.hold(st.flow, st.metrics, ex.tenant, ex.id, ex.flow_band, rreq, ex.route, ex.parsed,
                                         st.config.pool(first_pool).timing, expected)
                ex.headers.update(passed.headers)
                held, ex.engine_boost = passed.decision, passed.boost
            ex.span = start_span(st.tracer, ex.endpoint, ex.parsed, ex.tenant.name, ex.request_id)
            stage = "decide"
            if held is None or rreq is None:  # not held: routed now, on the fleet as it is now
                rreq = await self._routing(ex)
            ex.rreq = rreq
            ex.decision = await decide.decide(st.router, st.metrics, ex.rreq, ex.route, held)
            ex.headers["x-gateway-route"] = ex.decision.branch
            chosen = ex.decision.chosen
            if chosen is not None and chosen.ttft > 0:  # what routing expected of it: the replica's TTFT, from send
                ex.headers["x-gateway-ttft-predicted-ms"] = str(int(chosen.ttft * 1000))
            decide.refuse_shed(st.control.name_override, ex.tenant.name, ex.decision)
            if decided is not None:
                decided(ex)
            stage = "budget"
            worst = budget.worst_case(st.config, st.registry, ex.tenant, ex.parsed, ex.route.pools)
            ex.reservation = await budget.reserve(st.budget, st.metrics, ex.tenant, ex.id, worst,
                                                  st.config.routing.budget_lease_s)
        except BaseException as e:
            for b in ex.buckets:
                self._background(st.limiter.adjust(b, b.cost))
            ex.buckets = []
            status, reason = reason_for(stage, e)
            refused = Outcome(status=status, reason=reason, error=e.message if isinstance(e, GatewayError) else None)
            await self.accounting.finish(ex, refused, disconnected=False)
            raise

    async def _routing(self, ex: Exchange) -> RoutingRequest:
        """The request as the router sees it: with the hashes the front half computed (front.py) when they are this
        request's, else a large body's hashing off the event loop."""
        st = self.state
        hasher, size = st.prefix_hasher, ex.body_bytes
        front = ex.call.front
        if front is not None and front.hashed is not None:
            hasher = front.hasher(st.prefix_hasher)
            ns = ex.tenant.cache_namespace(ex.parsed.body.get("cache_salt"))
            if front.covers(ex.endpoint, ex.parsed.body, ex.route.name, ns, st.config.routing.chunk_tokens):
                size = 0  # nothing left to compute: inline
        return await st.cpu.run(size, decide.routing_request, st.config.routing, ex.id, ex.tenant, ex.endpoint,
                                ex.parsed, ex.route.name, ex.call, hasher)

    async def _serve(self, request: Request, ex: Exchange) -> Response:
        st = self.state
        try:  # a repeat of a request already served: its outcome
            replay = await idempotency.begin(st.idempotency, st.config.idempotency.max_replay_bytes,
                                             request.headers.get(idempotency.HEADER), ex.tenant.name, ex.endpoint,
                                             ex.parsed.body)
        except GatewayError as e:
            await self.accounting.finish(ex, Outcome(status=str(e.status), reason="idempotency", error=e.message),
                                         disconnected=False)
            raise
        if isinstance(replay, idempotency.Held):
            ex.idem = replay
        elif replay is not None:
            await self.accounting.finish(ex, Outcome(reason="idempotent_replay"), disconnected=False)
            return replay
        await self.admit(ex)
        out = Outcome.answering(ex.headers)  # the relay's record of the answer, from here on
        if ex.parsed.stream:
            return EventStreamResponse(lambda: self.relay.stream_first(ex, out), lambda: self.relay.stream_rest(ex, out),
                                       out.headers,
                                       on_close=lambda disconnected: self.accounting.finish(ex, out, disconnected),
                                       stall_timeout=st.config.timeouts.client_stall,
                                       on_stall=lambda: stalled(out), live=self.live,
                                       on_cut=lambda committed: cut_by_shutdown(ex, out, committed))
        return await self.respond(request, ex, out, self.relay.non_stream(ex, out))

    async def respond(self, request: Request, ex: Exchange, out: Outcome,
                      work: Coroutine[Any, Any, Response]) -> Response:
        """A non-streamed answer: `work` (which fills `out`) runs until done or the client leaves (499), and is
        accounted once."""
        disconnected = True
        try:
            disconnected, resp = await run_until_disconnect(request.receive, work)
        except GatewayError:  # the relay recorded the outcome (status, reason, who was tried)
            disconnected = False
            raise
        except Exception:
            disconnected = False
            out.status, out.reason = "500", "internal"
            raise
        finally:
            await self.accounting.finish(ex, out, disconnected)
        return resp if not disconnected else Response(status_code=499)

    # -- background work (settlements) -----------------------------------------------------------------------
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
