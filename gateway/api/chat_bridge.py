"""The seam the Responses and Messages APIs share: their requests become a chat/completions body handed to the
one chat path (`Pipeline.handle(..., body=...)`), so tenancy, limits, budgets, routing, metrics, traces and the
decision log apply unchanged and every pool kind serves them. This module only moves bytes between the two
shapes; each API's own translation lives in its package.

    client --(API body)--> translate --(chat body)--> proxy.handle --(chat JSON | chat SSE)--> translate --> client

A stream is written in the API's shape by the relay itself: the adapter passes its encoder (a `StreamEncoder`
wrapped in `Ending`) in the request's `Call`, and the relay hands it each upstream chunk as the dict it parsed once
— no chat SSE is framed only to be parsed again. The commit point is unchanged (no status line before the first
upstream chunk), so an error before it is still a real HTTP error, rendered in the API's shape by `render_error`;
one after it becomes the API's in-band error event (`StreamEncoder.error`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.offload import CpuPool
from gateway.pipeline.body import read_body
from gateway.pipeline.call import Call, StreamEncoder
from gateway.pipeline.json_body import MAX_JSON_DEPTH
from gateway.routing.request import MAX_SESSION_CHARS

T = TypeVar("T")


def note_refusal(request: Request, model: object, err: GatewayError, served: str | None = None) -> None:
    """What the request log line of a bridge's own refusal carries (api/refusals.py reads it): the model when it
    could be read (the served model an alias resolves to, else the name as sent, bounded) and a bounded reason —
    the error's code or type and the field it names, never its message, which may quote the client's text."""
    reason = err.code or err.type
    if err.param:
        reason = f"{reason} ({err.param})"
    name = served or (model[:64] if isinstance(model, str) and model else None)
    request.scope.setdefault("state", {})["refusal"] = {"model": name, "error": reason[:120]}


async def read_json(request: Request, limit: int, cpu: CpuPool) -> tuple[dict[str, Any], int]:
    """The client's body, bounded like the chat path's (413 past `limit`), as a JSON object (else 400), and its size
    in bytes (a large body is parsed off the event loop, and so are its later steps)."""
    raw = await read_body(request, limit)
    return await cpu.parse(raw), len(raw)


async def read_front(request: Request, limit: int, cpu: CpuPool, job: Callable[..., T],
                     plain: Callable[[int], Any]) -> tuple[T, int]:
    """The client's body, bounded like the chat path's (413 past `limit`), parsed (400 if it is no JSON object) and
    run through `job(body, plain(size))`, the API's front half (a large body's all of it in a worker process:
    `CpuPool.front`; `plain(size)`: what it needs of live state for a body of that size); and its size in bytes."""
    raw = await read_body(request, limit)
    return await cpu.front(raw, MAX_JSON_DEPTH, job, plain(len(raw))), len(raw)


def with_bearer(request: Request, api_key: str | None) -> Request:
    """The request the chat path sees: `authorization: Bearer <api_key>` when the client authenticated some other
    way (Anthropic clients send `x-api-key`); the chat path identifies the tenant from `authorization` only."""
    if api_key is None:
        return request
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"] + \
        [(b"authorization", b"Bearer " + api_key.encode("latin-1"))]
    return Request(scope, request.receive)


async def call_chat(proxy: Any, request: Request, body: dict[str, Any], call: Call) -> Response:
    """The chat path's answer to `body`, accounted (metrics, log line) under the API the client spoke and routed
    with what the adapter knows (the agent session, the stored turn's replica): `call`."""
    out: Response = await proxy.handle(request, "chat/completions", body=body, call=call)
    return out


def session_of(*candidates: object) -> str | None:
    """The first usable session id among the client's candidates (bounded; non-strings and empties skipped)."""
    for c in candidates:
        if isinstance(c, str) and c.strip():
            return c.strip()[:MAX_SESSION_CHARS]
    return None


def first_choice(chunk: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(choice, delta) of a chat.completion.chunk's first choice; None for a chunk without one (the usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    return choices[0], choices[0].get("delta") or {}


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Ending:
    """An API's stream encoder, handed to the relay through the Call (pipeline/call.py), that remembers whether its stream
    was ended — by the upstream's end or by an error event — so the bridge never lets it close silently."""

    def __init__(self, inner: StreamEncoder) -> None:
        self.inner = inner
        self.ended = False

    def start(self) -> bytes:
        return self.inner.start()

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        return self.inner.chunk(chunk)

    def error(self, error: dict[str, Any]) -> bytes:
        self.ended = True
        return self.inner.error(error)

    def done(self) -> bytes:
        self.ended = True
        return self.inner.done()


ErrorRenderer = Callable[[int, dict[str, Any], list[tuple[bytes, bytes]]], Response]


class TranslatedStream(Response):
    """The chat path's streaming response for another API: the relay already writes each event in that API's shape
    (its `encoder`, an `Ending`, passed in the request's Call), so this only adds the bridge's own headers on commit,
    re-renders an answer refused before the commit point with `render_error(status, openai_error_body, headers)`,
    makes sure the stream never closes without its end or an error event, and runs `on_end` after the last byte."""

    def __init__(self, inner: Response, encoder: Ending, render_error: ErrorRenderer,
                 on_end: Callable[[], Any] | None = None) -> None:
        self.inner = inner
        self.encoder = encoder
        self.render_error = render_error
        self.on_end = on_end  # awaited after the last byte (e.g. store the finished response)
        self.background = None
        self.status_code = 200  # what it will be if the chat path commits; its own headers go out as sent
        self.raw_headers = []
        self.sent_headers: list[tuple[bytes, bytes]] = []  # the chat path's, once it committed (x-gateway-replica)
        self.extra_headers: list[tuple[bytes, bytes]] = []  # the bridge's own (x-gateway-dropped), sent on commit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 200
        start: Message | None = None
        error_body = b""

        async def relay(message: Message) -> None:
            nonlocal status, start, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
                start = message
                if status == 200:
                    self.sent_headers = list(message.get("headers", []))
                    if self.extra_headers:
                        message = {**message, "headers": self.sent_headers + self.extra_headers}
                    await send(message)
                return
            if message["type"] != "http.response.body":
                return
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if status != 200:  # an error before the commit point: buffer it, re-render it in the API's shape
                error_body += body
                if not more:
                    await self._send_error(status, error_body, start, scope, receive, send)
                return
            if not more and not self.encoder.ended:  # the chat path always ends its stream; never close silently
                body += self.encoder.error({"message": "The upstream stream ended before it was complete.",
                                            "type": "server_error", "code": "upstream_error"})
            await send({"type": "http.response.body", "body": body, "more_body": more})

        await self.inner(scope, receive, relay)
        if self.on_end is not None and status == 200:
            res = self.on_end()
            if res is not None:
                await res

    def header(self, name: bytes) -> str | None:
        """A header the chat path sent with its committed stream (None before, or when absent)."""
        return next((v.decode("latin-1") for k, v in self.sent_headers if k == name), None)

    async def _send_error(self, status: int, raw: bytes, start: Message | None, scope: Scope, receive: Receive,
                          send: Send) -> None:
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = {}
        headers = [(k, v) for k, v in (start or {}).get("headers", []) if k not in (b"content-length", b"content-type")]
        await self.render_error(status, body if isinstance(body, dict) else {}, headers)(scope, receive, send)


def json_body(resp: Response) -> dict[str, Any] | None:
    """The JSON object of a non-streaming chat-path response (None for a 499, whose client is gone)."""
    if resp.status_code != 200:
        return None
    try:
        body = orjson.loads(bytes(resp.body))
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def passthrough_headers(resp: Response) -> dict[str, str]:
    """The chat path's gateway headers (replica, route, cost, rate limits) for the bridged response."""
    return {k: v for k, v in resp.headers.items() if k.startswith(("x-", "retry-after"))}
