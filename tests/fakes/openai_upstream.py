"""A small OpenAI-compatible upstream that records what it receives: stands in for a hosted provider
(the `openai` pool kind) and lets tests see the exact body the gateway forwarded."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


class FakeOpenAI:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.status = 200  # next responses' status
        self.error_body: dict[str, Any] = {"error": {"message": "provider says no", "type": "server_error", "code": None}}
        self.inband_error_after: int | None = None  # stream: send an error event after k chunks
        self.delay = 0.0
        self.inflight = self.max_inflight = 0  # requests held by `delay` now / at most at once
        # the usage it reports (tests set garbage here: upstream usage is untrusted input)
        self.usage: Any = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                           "prompt_tokens_details": {"cached_tokens": 2}}

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])

    async def models(self, request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": "hosted-glm", "object": "model"}]}),
                        media_type="application/json")

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.delay:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.inflight -= 1
        if self.status != 200:
            return Response(orjson.dumps(self.error_body), status_code=self.status, media_type="application/json")
        usage = self.usage
        head = {"id": "chatcmpl-fake", "created": 1, "model": body.get("model")}
        if not body.get("stream"):
            return Response(orjson.dumps({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi there friend"}, "finish_reason": "stop"}],
                "usage": usage}), media_type="application/json")

        async def gen() -> Any:
            words = ["hi", " there", " friend"]
            yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + b"\n\n"
            for i, w in enumerate(words):
                if self.inband_error_after is not None and i >= self.inband_error_after:
                    yield b'data: {"error": {"message": "provider overloaded", "type": "server_error", "code": 503}}\n\n'
                    return
                yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": w}, "finish_reason": None}]}) + b"\n\n"
            yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")
