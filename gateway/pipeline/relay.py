"""Relay: dispatch the decision and give the client the upstream's answer as its own.

Non-streamed: one JSON response with the client's model name, the clamped usage and `x-gateway-cost-usd`.
Streamed: an `EventStreamResponse` whose first chunk is the dispatch (before the commit point an upstream failure
is still a real HTTP error), then each upstream event re-labelled with the client's model name. The engine's usage
chunk is kept for metering (clamped, pipeline/usage.py) and shown only if the client asked for it, then with
the request's cost in `usage.cost_usd`. After the commit point a failure is one SSE error event and no [DONE].

The relay reads the exchange (what was asked, what the stages returned) and writes only the request's `Outcome`
(pipeline/outcome.py), handed to it before it asks the upstream: for a stream, event by event. (What the answer sent
is also recorded in the held Idempotency-Key, the idempotency stage's own record: a repeat is sent it again.)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response

from gateway.api.error_handlers import to_response
from gateway.asgi import PushBody
from gateway.backends.openai_compat import sanitize_upstream_text
from gateway.config import GatewayConfig
from gateway.control.plane import ControlPlane
from gateway.dispatch.dispatcher import Dispatched, Dispatcher
from gateway.dispatch.feedback import Feedback
from gateway.errors import GatewayError, NoCapacity
from gateway.pipeline import idempotency
from gateway.pipeline.budget import usage_bound
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Outcome
from gateway.pipeline.refusal import upstream_reason
from gateway.pipeline.relay_stream import Framer, PushedStream, error_of, framed, stream_error
from gateway.pipeline.usage import UsageBound, clean_usage, usage_counts
from gateway.prediction.pricing import request_cost
from gateway.upstreams import UpstreamRegistry


def cut_by_shutdown(ex: Exchange, out: Outcome, committed: bool) -> bytes | Response:
    """How a stream still running when the shutdown's drain timeout ends is cut: an error event after what was
    relayed (billed for that, as a client that left is: accounting), or a 503 to retry when nothing was sent yet."""
    out.end("shutdown", "cut: the gateway shut down before the stream ended (drain timeout)")
    if committed:
        return stream_error(ex, error_of("The gateway is shutting down and could not finish this stream within its "
                                         "drain timeout; the answer above is incomplete.", "service_unavailable_error",
                                         "server_shutting_down"))
    out.status = "503"
    return to_response(NoCapacity("The gateway is shutting down; retry the request.", retry_after=1,
                                  should_retry=True))


def stalled(out: Outcome) -> None:
    """A client that stopped reading: its stream is aborted (EventStreamResponse's `on_stall`)."""
    out.end("client_stall", "the client stopped reading; stream aborted")


def dispatch_failed(out: Outcome, e: GatewayError) -> None:
    """Record who was tried (the dispatcher sets `target`/`attempts` on its errors) and the outcome."""
    out.status, out.error = str(e.status), e.message
    out.error_target = getattr(e, "target", None)
    out.error_attempts = int(getattr(e, "attempts", 0) or 0)
    out.reason = upstream_reason(e.status, e.code)


def cost(dispatched: Dispatched | None, usage: dict[str, Any] | None) -> float:
    """What `usage` costs at the prices of the target that served it (nothing when none did)."""
    if dispatched is None:
        return 0.0
    prompt, cached, completion = usage_counts(usage)
    return request_cost(dispatched.target.pricing, prompt, cached or 0, completion)


async def _one_by_one(rest: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """A backend's payloads as reads of one each (a backend without `Opened.reads`)."""
    async for payload in rest:
        yield [payload]


class Relay:
    def __init__(self, dispatcher: Dispatcher, feedback: Feedback, control: ControlPlane, config: GatewayConfig,
                 registry: UpstreamRegistry) -> None:
        """`control`: names an on-call override behind a capacity refusal; `config`, `registry`: the usage bounds."""
        self.dispatcher, self.feedback, self.control = dispatcher, feedback, control
        self.config, self.registry = config, registry
        self._model_swap: dict[tuple[str, str], tuple[bytes, bytes, bytes, bytes]] = {}

    async def _open(self, ex: Exchange, out: Outcome) -> Dispatched:
        assert ex.decision is not None and ex.rreq is not None
        # the attempt spans hang under the request span, passed explicitly: making it current would attach and
        # detach an OTel context on every request, tracing on or off
        try:
            d = await self.dispatcher.open(ex.decision, ex.rreq, ex.parsed.body, ex.deadline, ex.tenant,
                                           parent=ex.span, boost=ex.engine_boost)
        except GatewayError as e:
            raise self.control.name_override(ex.tenant.name, e) from None
        out.dispatched = d
        out.first_token_at = time.monotonic()
        out.headers["x-gateway-pool"] = d.target.pool
        out.headers["x-gateway-replica"] = d.target.name
        out.headers["x-gateway-attempts"] = str(d.attempts)
        if d.opened.choice is not None:  # a PD pool: the pair decision's branch and prefill rank
            out.headers["x-gateway-pd"] = d.opened.choice
        return d

    def bound(self, ex: Exchange, out: Outcome) -> UsageBound:
        """The most the request can have used on the pool that served it (before dispatch: on any of its route's)."""
        pools = [out.dispatched.target.pool] if out.dispatched is not None else ex.route.pools
        return usage_bound(self.config, self.registry, ex.parsed, pools)

    # -- non-streaming ---------------------------------------------------------------------------------------
    async def non_stream(self, ex: Exchange, out: Outcome) -> Response:
        try:
            d = await self._open(ex, out)
        except GatewayError as e:
            dispatch_failed(out, e)
            raise
        self.feedback.first_token(d.attempt, None)  # the whole response: not a TTFT observation
        body = d.opened.body if isinstance(d.opened.body, dict) else {}
        out.usage, out.usage_anomalies = clean_usage(body.get("usage"), self.bound(ex, out))
        if out.usage is not None:
            body["usage"] = out.usage
        body["model"] = ex.parsed.model
        out.headers["x-gateway-cost-usd"] = f"{cost(d, out.usage):.8f}"
        data = orjson.dumps(body)
        idempotency.answered(ex.idem, out.headers, data)
        return Response(data, media_type="application/json", headers=out.headers)

    # -- streaming -------------------------------------------------------------------------------------------
    async def stream_first(self, ex: Exchange, out: Outcome) -> Response | bytes:
        try:
            d = await self._open(ex, out)
        except GatewayError as e:  # before the commit point: a real HTTP error the SDK can act on
            dispatch_failed(out, e)
            return to_response(e)  # x-request-id is added by RequestIdMiddleware like on every response
        assert out.first_token_at is not None
        self.feedback.first_token(d.attempt, out.first_token_at - ex.started, out.first_token_at)
        enc = ex.call.encoder
        if enc is not None:  # another API's stream: its opening events, then the first chunk in its shape
            first = enc.start() + (self._relay(ex, out, d.opened.first or b"") or b"")
        else:
            first = self._relay(ex, out, d.opened.first or b"") or b": stream open\n\n"
        idempotency.streamed(ex.idem, first)
        return first

    def stream_rest(self, ex: Exchange, out: Outcome) -> AsyncIterator[bytes] | PushBody:
        """The stream after its first chunk (relay_stream.py): pushed from the HTTP client's read callback when the
        backend can (an H1 upstream) and the client's API is the upstream's own, else a read at a time."""
        d = out.dispatched
        assert d is not None and d.opened.rest is not None
        framer = Framer(self, ex, out)
        if d.opened.push is not None and ex.call.encoder is None:
            return PushedStream(framer, d.opened.push)
        reads = d.opened.reads if d.opened.reads is not None else _one_by_one(d.opened.rest)
        return framed(framer, reads)

    def _relay(self, ex: Exchange, out: Outcome, payload: bytes,
               swap: tuple[bytes, bytes, bytes, bytes] | None = None, counted: bool = False) -> bytes | None:
        """One upstream payload as the client should see it: the client's model name; the usage chunk kept for
        metering and shown (clamped, with the cost) only if the client asked for it. `swap`: the stream's model
        name replacements (`_swap`), if the caller has them; `counted`: the caller counted the payload already."""
        if not counted:
            out.chunks += 1
        if b'"choices":[]' in payload and b'"usage"' in payload:
            return self._usage_chunk(ex, out, payload)
        enc = ex.call.encoder
        if enc is not None:  # parsed once, written in the client's API: no chat SSE framed only to be re-parsed
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
            return enc.chunk(chunk) if isinstance(chunk, dict) else None
        old, new, old2, new2 = swap if swap is not None else self._swap(ex, out)
        if old != new:
            payload = payload.replace(old, new, 1).replace(old2, new2, 1)
        return b"data: " + payload + b"\n\n"

    def _usage_chunk(self, ex: Exchange, out: Outcome, payload: bytes) -> bytes | None:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            out.usage_anomalies = ["malformed"]
            return None
        out.usage, out.usage_anomalies = clean_usage(chunk.get("usage"), self.bound(ex, out))
        enc = ex.call.encoder
        if enc is not None:  # the other API reports usage in its own closing events: always handed over (clamped)
            return enc.chunk({**chunk, "usage": out.usage}) if out.usage is not None else None
        if not ex.parsed.include_usage or out.usage is None:
            return None
        chunk["model"] = ex.parsed.model
        chunk["usage"] = {**out.usage, "cost_usd": round(cost(out.dispatched, out.usage), 10)}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _swap(self, ex: Exchange, out: Outcome) -> tuple[bytes, bytes, bytes, bytes]:
        assert out.dispatched is not None
        key = (out.dispatched.target.upstream_model, ex.parsed.model)
        s = self._model_swap.get(key)
        if s is None:
            up, client = orjson.dumps(key[0]), orjson.dumps(key[1])
            s = (b'"model":' + up, b'"model":' + client, b'"model": ' + up, b'"model": ' + client)
            self._model_swap[key] = s
        return s

    @staticmethod
    def _rewrap_error(payload: bytes) -> dict[str, Any]:
        """An upstream's in-band error event as the gateway's: its text sanitised, overload told apart."""
        try:
            err = orjson.loads(payload).get("error") or {}
        except (orjson.JSONDecodeError, AttributeError):
            err = {}
        code = err.get("code") if isinstance(err, dict) else None
        overloaded = code in (503, 429, "503")
        return error_of(sanitize_upstream_text(str((err or {}).get("message", "upstream error"))) or "upstream error",
                        "service_unavailable_error" if overloaded else "server_error",
                        "server_is_overloaded" if overloaded else "upstream_error")
