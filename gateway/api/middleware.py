"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers)."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api import refusals
from gateway.errors import GatewayError

log = logging.getLogger("gateway.errors")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Accept the client's x-request-id (if sane), else mint one; put it on every response. The outermost layer,
    so it also turns an exception that escaped every handler before the response started into a 500 in the OpenAI
    shape (uvicorn's own answer would be plain text)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def _pipeline(self) -> Any:
        """The request pipeline, whose accounting records refusals (the admin-only app reaches it through the main
        app), None before the lifespan ran."""
        st = getattr(self.app, "state", None)
        main = getattr(st, "main", None)
        if main is not None:
            st = getattr(main, "state", None)
        return getattr(st, "proxy", None)

    @property
    def state(self) -> object:
        return self.app.state  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                cand = v.decode("latin-1")
                rid = cand if _SAFE_ID.match(cand) else None
                break
        rid = rid or new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.monotonic()
        send_with_id = _SendWithId(self, scope, send, rid.encode(), t0)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if send_with_id.started:
                raise  # the response is on its way; uvicorn closes the connection and logs
            log.exception("unhandled error before a response on %s", scope.get("path"))
            await _internal_error(send_with_id)


class _SendWithId:
    """The response's `send` with the request id added to its start. It changes nothing after the start, so it
    offers the server's own send as `body_send`: a stream sends its body there (`asgi.EventStreamResponse`), one
    call less per event."""

    __slots__ = ("body_send", "mw", "raw", "scope", "started", "t0")

    def __init__(self, mw: RequestIdMiddleware, scope: Scope, send: Send, raw: bytes, t0: float) -> None:
        self.mw, self.scope, self.body_send, self.raw, self.t0 = mw, scope, send, raw, t0
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = list(message.get("headers", []))
            if not any(k == b"x-request-id" for k, _ in headers):
                headers.append((b"x-request-id", self.raw))
            message["headers"] = headers
            status = message.get("status", 200)
            if status >= 400 and refusals.counted(self.scope):
                pipeline = self.mw._pipeline()
                if pipeline is not None:
                    refusals.account(pipeline, self.scope, status, self.t0)
        await self.body_send(message)


def new_request_id() -> str:
    """A random UUID4 as 32 hex digits, like uuid.uuid4().hex at a third of its cost."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # RFC 4122 variant
    return b.hex()


async def _internal_error(send: Send) -> None:
    body = orjson.dumps(GatewayError("The gateway hit an internal error.").body())
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
