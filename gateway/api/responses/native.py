"""Native pass-through: /v1/responses forwarded to the pool's own /v1/responses (pools with `responses: native`).

The chat path's stages run in the same order, with the same modules, around a Responses body: the tenant's key,
its concurrency slot, entitlements (and `x-gateway-pool`), the fleet slot and rate limits, the routing decision,
the budget reservation, the dispatcher (retries, failover, breakers, load feedback; endpoint `responses`) and the
chat path's `Accounting` (metrics, SLA, budget settlement, rate-limit adjustment, decision ring, span, log line),
exactly once per request. Routing and admission see the request's chat form (the bridge's translation, or a
stand-in when the bridge cannot translate it, e.g. a hosted tool), so a chain hashes the same prefix in both modes.
Only the relay is this module's own: the upstream's Responses JSON or events go to the client as they came (the
client's model name put back), and the Responses usage is mapped to chat usage for accounting
(`input_tokens_details.cached_tokens` -> `prompt_tokens_details.cached_tokens`). Like the chat relay, it writes only
the request's `Outcome` (pipeline/outcome.py), never the exchange after `admit`.

State stays in the gateway: the upstream is sent `store: false`, and a `previous_response_id` is resolved from the
gateway's own store (this tenant's only) and sent as the history expanded into `input` (stored ids stripped, past
reasoning items kept only with their `encrypted_content`). So tenancy, retrieve / delete / input_items and failover
to another pool of the route work exactly as bridged.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import orjson
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.error_handlers import to_response
from gateway.api.responses.affinity import served_by
from gateway.api.responses.store import ResponseStore
from gateway.api.responses.translate import new_id, parse_request
from gateway.asgi import EventStreamResponse
from gateway.backends.base import StreamBroken
from gateway.backends.openai_compat import sanitize_upstream_text
from gateway.config import ModelRoute
from gateway.dispatch.dispatcher import Dispatched
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound
from gateway.pipeline.call import Call
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Outcome
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.relay import cost, cut_by_shutdown, dispatch_failed, stalled
from gateway.pipeline.usage import clean_usage
from gateway.state import AppState

ENDPOINT = "responses"
TERMINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"error"})
_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")


def is_native(st: AppState, model: Any) -> bool:
    """The model's pools serve Responses themselves (config validation keeps one mode per model)."""
    route = next((m for m in st.config.models if m.name == model), None)
    return route is not None and st.config.pool(route.pools[0]).responses == "native"


# -- bodies (pure) -------------------------------------------------------------------------------------------
def input_items(raw: Any) -> list[dict[str, Any]]:
    """This turn's input as items, as the client sent them (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not all(isinstance(i, dict) for i in raw):
        raise InvalidRequest("'input' must be a string or an array of input items.", param="input")
    return list(raw)


def _replayable(item: dict[str, Any]) -> dict[str, Any] | None:
    """A stored item as input to an upstream that stored nothing: without its id (nothing to look up); a reasoning
    item only with its encrypted content (else the upstream could not use it)."""
    if item.get("type") == "reasoning" and not item.get("encrypted_content"):
        return None
    return {k: v for k, v in item.items() if k != "id"}


def upstream_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    if history:
        past = [i for i in (_replayable(h) for h in history) if i is not None]
        out["input"] = past + input_items(body["input"])
    out["store"] = False  # the gateway keeps the conversation (see the module docstring)
    return out


def chat_form(body: dict[str, Any], history: list[dict[str, Any]], auto_truncate: int) -> dict[str, Any]:
    """The request as routing and admission see it: the bridge's chat body when it can translate it (the same
    prefix hashes as a bridged chain), else the input as JSON text in one user message (still deterministic)."""
    try:
        return parse_request({**body, "store": False}, history, auto_truncate).chat
    except (InvalidRequest, KeyError, TypeError, AttributeError):  # a Responses feature the bridge does not map
        instructions = body.get("instructions")
        msgs = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
        text = orjson.dumps(history + input_items(body.get("input"))).decode()
        chat: dict[str, Any] = {"model": body.get("model"), "stream": body.get("stream") is True,
                                "messages": msgs + [{"role": "user", "content": text}]}
        if isinstance(body.get("max_output_tokens"), int):
            chat["max_tokens"] = body["max_output_tokens"]
        return chat


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Responses usage as the chat usage accounting reads (cleaned and clamped by the caller)."""
    if not isinstance(usage, dict):
        return None if usage is None else {"prompt_tokens": "malformed"}
    details = usage.get("input_tokens_details")
    out: dict[str, Any] = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


# -- the request ---------------------------------------------------------------------------------------------
class NativeResponses:
    """One native /v1/responses request through the chat path's stages (see the module docstring)."""

    def __init__(self, request: Request, proxy: Pipeline, store: ResponseStore, tenant_name: str,
                 body: dict[str, Any], history: list[dict[str, Any]], call: Call) -> None:
        self.request, self.proxy, self.store, self.tenant_name = request, proxy, store, tenant_name
        self.call = call
        self.st: AppState = proxy.state
        self.body = upstream_body(body, history)
        self.stored_items = history + [{"id": new_id("msg"), **i} if "id" not in i else i
                                       for i in input_items(body["input"])]
        self.keep = body.get("store", True) is not False
        self.parent = body.get("previous_response_id")  # the stored turn this one continues (the store keeps the delta)
        self.chat = chat_form(body, history, self.st.config.responses.auto_truncate_input_tokens)
        self._swaps: list[tuple[bytes, bytes]] = []
        self._last_response: dict[str, Any] = {}
        self._seq = -1

    async def handle(self) -> Response:
        # the chat path's stages up to the exchange (key, slot, validation of the chat form, entitlements, limits),
        # with the route narrowed to the pools that serve /v1/responses themselves; the chat form's endpoint for
        # routing (its prefix hashes), ENDPOINT once dispatched
        ex = await self.proxy.begin(self.request, "chat/completions", self.chat, self.call, pools=_native_pools(self.st))
        if isinstance(ex, Response):
            return ex
        return await self._serve(ex)

    async def _serve(self, ex: Exchange) -> Response:
        st = self.st
        await self.proxy.admit(ex, decided=_native_endpoint)  # the chat path's stages before dispatch, its refusals
        out = Outcome.answering(ex.headers)  # this relay's record of the answer, from here on
        if ex.parsed.stream:
            return EventStreamResponse(lambda: self._first(ex, out), lambda: self._rest(ex, out), out.headers,
                                       on_close=lambda disconnected: self._finish(ex, out, disconnected),
                                       stall_timeout=st.config.timeouts.client_stall, on_stall=lambda: stalled(out),
                                       live=self.proxy.live, on_cut=lambda committed: self._cut(ex, out, committed))
        return await self.proxy.respond(self.request, ex, out, self._non_stream(ex, out))

    async def _finish(self, ex: Exchange, out: Outcome, disconnected: bool) -> None:
        await self.proxy.accounting.finish(ex, out, disconnected)

    async def _open(self, ex: Exchange, out: Outcome) -> Dispatched:
        assert ex.decision is not None and ex.rreq is not None
        with trace.use_span(ex.span, end_on_exit=False):  # attempt spans become children of the request span
            d = await self.st.dispatcher.open(ex.decision, ex.rreq, self.body, ex.deadline, ex.tenant,
                                              boost=ex.engine_boost)
        out.dispatched = d
        out.first_token_at = time.monotonic()
        out.headers.update({"x-gateway-pool": d.target.pool, "x-gateway-replica": d.target.name,
                           "x-gateway-attempts": str(d.attempts)})
        up, client = orjson.dumps(d.target.upstream_model), orjson.dumps(ex.parsed.model)
        if up != client:
            self._swaps += [(b'"model":' + up, b'"model":' + client), (b'"model": ' + up, b'"model": ' + client)]
        return d

    def _own_id(self, upstream_id: Any) -> None:
        """An upstream id the gateway's store cannot key (not `resp_<alnum>`) is replaced with the gateway's own."""
        if isinstance(upstream_id, str) and not _ID.match(upstream_id):
            self._swaps.append((orjson.dumps(upstream_id), orjson.dumps(new_id("resp"))))

    def _swap(self, payload: bytes) -> bytes:
        for old, new in self._swaps:
            payload = payload.replace(old, new)
        return payload

    async def _keep(self, out: Outcome, response: dict[str, Any]) -> None:
        rid = response.get("id")
        if self.keep and isinstance(rid, str) and _ID.match(rid):
            await self.store.put(self.tenant_name, rid, orjson.dumps({
                "response": response, "input_items": self.stored_items, "parent": self.parent,
                "served_by": served_by(out.headers.get("x-gateway-replica"), response)}))

    # -- non-streamed ----------------------------------------------------------------------------------------
    async def _non_stream(self, ex: Exchange, out: Outcome) -> Response:
        try:
            d = await self._open(ex, out)
        except GatewayError as e:
            dispatch_failed(out, e)
            raise
        self.st.feedback.first_token(d.attempt, None)
        raw = d.opened.body if isinstance(d.opened.body, dict) else {}
        self._own_id(raw.get("id"))
        response: dict[str, Any] = orjson.loads(self._swap(orjson.dumps(raw)))
        out.usage, out.usage_anomalies = clean_usage(chat_usage(response.get("usage")),
                                                     self.proxy.relay.bound(ex, out))
        out.headers["x-gateway-cost-usd"] = f"{cost(d, out.usage):.8f}"
        await self._keep(out, response)
        return Response(orjson.dumps(response), media_type="application/json", headers=out.headers)

    # -- streamed --------------------------------------------------------------------------------------------
    async def _first(self, ex: Exchange, out: Outcome) -> Response | bytes:
        try:
            d = await self._open(ex, out)
        except GatewayError as e:  # before the commit point: a real HTTP error
            dispatch_failed(out, e)
            return to_response(e)
        assert out.first_token_at is not None
        self.st.feedback.first_token(d.attempt, out.first_token_at - ex.started, out.first_token_at)
        first, _ = await self._event(ex, out, d.opened.first or b"")
        return first or b": stream open\n\n"

    async def _rest(self, ex: Exchange, out: Outcome) -> AsyncIterator[bytes]:
        d = out.dispatched
        assert d is not None and d.opened.rest is not None
        try:
            async for payload in d.opened.rest:
                chunk, done = await self._event(ex, out, payload)
                if chunk:
                    yield chunk
                if done:
                    return
        except StreamBroken as e:
            yield self._failed(out, f"The upstream failed mid-stream: {e}")
            return
        yield self._failed(out, "The upstream closed the stream before the response was complete.")

    async def _event(self, ex: Exchange, out: Outcome, payload: bytes) -> tuple[bytes, bool]:
        """(bytes for the client, whether the stream is over) for one upstream payload."""
        out.chunks += 1
        if payload == b"[DONE]":
            return b"", False
        if payload.startswith(b'{"error"'):  # a chat-style in-band error (e.g. SGLang): the Responses error events
            try:
                err = orjson.loads(payload).get("error") or {}
            except (orjson.JSONDecodeError, AttributeError):
                err = {}
            msg = err.get("message") if isinstance(err, dict) else None
            return self._failed(out, sanitize_upstream_text(str(msg or "upstream error"))), True
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return b"", False
        if not isinstance(obj, dict):
            return b"", False
        kind = obj.get("type")
        seq = obj.get("sequence_number")
        if isinstance(seq, int):
            self._seq = seq
        if kind == "response.created" and isinstance(obj.get("response"), dict):
            self._own_id(obj["response"].get("id"))
        data = self._swap(payload)
        name = kind.encode() if isinstance(kind, str) else b"message"
        if name not in TERMINAL:
            if name in (b"response.created", b"response.in_progress"):
                self._last_response = orjson.loads(data).get("response") or {}
            return b"event: " + name + b"\ndata: " + data + b"\n\n", False
        if name == b"error":
            out.end("stream_error", "upstream error event")
        else:
            final = orjson.loads(data).get("response") or {}
            out.usage, out.usage_anomalies = clean_usage(chat_usage(final.get("usage")),
                                                         self.proxy.relay.bound(ex, out))
            if name == b"response.failed":
                out.end("stream_error", "upstream response.failed")
            await self._keep(out, final)
        return b"event: " + name + b"\ndata: " + data + b"\n\n", True

    def _cut(self, ex: Exchange, out: Outcome, committed: bool) -> bytes | Response:
        """A stream cut by the shutdown: the Responses error events (or the chat path's 503 before any byte)."""
        cut = cut_by_shutdown(ex, out, committed)
        if not committed:
            return cut
        events = self._failed(out, "The gateway is shutting down and could not finish this response within its "
                                   "drain timeout; it is incomplete.")
        out.reason = "shutdown"
        return events

    def _failed(self, out: Outcome, message: str) -> bytes:
        """A failure after the stream began: `error` then `response.failed`, never a silent close."""
        out.end("stream_error", message)
        err = {"type": "error", "code": "server_error", "message": message, "param": None,
               "sequence_number": self._seq + 1}
        failed = {**self._last_response, "status": "failed",
                  "error": {"code": "server_error", "message": message}}
        done = {"type": "response.failed", "sequence_number": self._seq + 2, "response": failed}
        self._seq += 2
        return (b"event: error\ndata: " + orjson.dumps(err) + b"\n\n" +
                b"event: response.failed\ndata: " + orjson.dumps(done) + b"\n\n")


def _native_endpoint(ex: Exchange) -> None:
    """Routed on the chat form (its prefix hashes); dispatched to the pool's own /v1/responses."""
    assert ex.rreq is not None
    ex.rreq, ex.endpoint = replace(ex.rreq, endpoint=ENDPOINT), ENDPOINT


def _native_pools(st: AppState) -> Callable[[ModelRoute], ModelRoute]:
    """A tenant's fallback pools may bridge: a Responses body goes only where /v1/responses is served (none: 404)."""
    def narrow(route: ModelRoute) -> ModelRoute:
        route = route.model_copy(update={"pools": [p for p in route.pools if st.config.pool(p).responses == "native"]})
        if not route.pools:
            raise ModelNotFound(f"The model '{route.name}' does not exist or you do not have access to it.",
                                param="model")
        return route
    return narrow

