"""A small OpenAI-compatible upstream that records what it receives: stands in for a hosted provider
(the `openai` pool kind) and lets tests see the exact body the gateway forwarded."""

from __future__ import annotations

import asyncio
import uuid
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
        self.chunk_delay = 0.0  # stream: seconds between content chunks
        self.fail_if: Any = None  # body -> bool: those bodies get `error_status` with `error_body`
        self.error_status = 500
        self.inject: tuple[int, bytes] | None = None  # stream: (k, raw bytes) sent as they are after k content chunks
        self.words = ["hi", " there", " friend"]  # stream: the content chunks
        self.inflight = self.max_inflight = 0  # requests held by `delay` now / at most at once
        # the usage it reports (tests set garbage here: upstream usage is untrusted input)
        self.usage: Any = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                           "prompt_tokens_details": {"cached_tokens": 2}}
        self.responses_cut_after: int | None = None  # /v1/responses stream: close after k text deltas, no end event
        self.response_ids = "resp_{hex}"  # format of the ids /v1/responses answers with

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
        ])

    async def models(self, request: Request) -> Response:
        if self.status in (401, 403):  # a key the provider refuses is refused everywhere
            return Response(orjson.dumps(self.error_body), status_code=self.status, media_type="application/json")
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
        if self.fail_if is not None and self.fail_if(body):
            return Response(orjson.dumps(self.error_body), status_code=self.error_status, media_type="application/json")
        usage = self.usage
        head = {"id": "chatcmpl-fake", "created": 1, "model": body.get("model")}
        if not body.get("stream"):
            return Response(orjson.dumps({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi there friend"}, "finish_reason": "stop"}],
                "usage": usage}), media_type="application/json")

        async def gen() -> Any:
            words = list(self.words)
            yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + b"\n\n"
            for i, w in enumerate(words):
                if self.inject is not None and i == self.inject[0]:
                    yield self.inject[1]
                if self.inband_error_after is not None and i >= self.inband_error_after:
                    yield b'data: {"error": {"message": "provider overloaded", "type": "server_error", "code": 503}}\n\n'
                    return
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": w}, "finish_reason": None}]}) + b"\n\n"
            yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    # -- /v1/responses: a provider serving the Responses API itself (state not kept: tests check store=false) --
    def _response(self, body: dict[str, Any], status: str, text: str) -> dict[str, Any]:
        u = self.usage if isinstance(self.usage, dict) else {}
        usage = {"input_tokens": u.get("prompt_tokens"), "output_tokens": u.get("completion_tokens"),
                 "total_tokens": u.get("total_tokens"),
                 "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        output = [{"type": "message", "id": "msg_fake", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
        return {"id": self._rid, "object": "response", "created_at": 1, "status": status, "model": body.get("model"),
                "output": output, "usage": usage if status == "completed" else None, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"), "metadata": {},
                "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
                "store": body.get("store", True)}

    async def responses(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            return Response(orjson.dumps(self.error_body), status_code=self.status, media_type="application/json")
        self._rid = self.response_ids.format(hex=uuid.uuid4().hex)
        words = ["hi", " there", " friend"]
        if not body.get("stream"):
            return Response(orjson.dumps(self._response(body, "completed", "".join(words))),
                            media_type="application/json")

        def ev(seq: int, kind: str, **data: Any) -> bytes:
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
                {"type": kind, "sequence_number": seq, **data}) + b"\n\n"

        async def gen() -> Any:
            item = {"type": "message", "id": "msg_fake", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            yield ev(0, "response.created", response=self._response(body, "in_progress", ""))
            yield ev(1, "response.in_progress", response=self._response(body, "in_progress", ""))
            yield ev(2, "response.output_item.added", output_index=0, item=item)
            yield ev(3, "response.content_part.added", item_id="msg_fake", output_index=0, content_index=0, part=part)
            seq = 4
            for i, w in enumerate(words):
                if self.responses_cut_after is not None and i >= self.responses_cut_after:
                    return
                yield ev(seq, "response.output_text.delta", item_id="msg_fake", output_index=0, content_index=0,
                         delta=w, logprobs=[])
                seq += 1
            text = "".join(words)
            yield ev(seq, "response.output_text.done", item_id="msg_fake", output_index=0, content_index=0, text=text,
                     logprobs=[])
            yield ev(seq + 1, "response.content_part.done", item_id="msg_fake", output_index=0, content_index=0,
                     part={**part, "text": text})
            done = self._response(body, "completed", text)
            yield ev(seq + 2, "response.output_item.done", output_index=0, item=done["output"][0])
            yield ev(seq + 3, "response.completed", response=done)

        return StreamingResponse(gen(), media_type="text/event-stream")
