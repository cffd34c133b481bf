"""Pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers)."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Accept the client's x-request-id (if sane), else mint one; put it on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", raw))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)
