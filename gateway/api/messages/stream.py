"""Chat chunks -> the Messages stream: `message_start`, `ping`, per content block `content_block_start`,
`content_block_delta` (`text_delta` or `input_json_delta`), `content_block_stop`, then `message_delta` (stop
reason, usage) and `message_stop`. An upstream failure after the stream began ends with an `error` event
(`api_error`, or `overloaded_error`), never a silent close.

`message_start` carries the gateway's estimate of the input tokens (the engine's count arrives only with the
last chunk); `message_delta.usage` carries the engine's figures, which the SDK's accumulator takes over."""

from __future__ import annotations

from typing import Any

from gateway.api.chat_bridge import first_choice, sse_event
from gateway.api.messages.output import stop_reason, stream_error_type, usage
from gateway.api.messages.translate import new_id


class MessagesStream:
    def __init__(self, model: str, estimated_input: int, stops: list[str] | None) -> None:
        self.model = model
        self.estimated_input = estimated_input
        self.stops = stops
        self.msg_id = new_id("msg")
        self.index = -1  # the open content block's index
        self.block: str | None = None  # "thinking", "text", or the open tool_use block's chat tool-call index as "tool:N"
        self.finish: str | None = None
        self.matched: Any = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> bytes:
        msg: dict[str, Any] = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.estimated_input, "output_tokens": 0, "cache_read_input_tokens": 0,
                         "cache_creation_input_tokens": 0}}
        return sse_event("message_start", {"type": "message_start", "message": msg}) + \
            sse_event("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                       "content_block": block})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        first = first_choice(chunk)
        if first is None:
            return b""
        choice, delta = first
        out = b""
        thought = delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            if self.block != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": thought})
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.block != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            key = f"tool:{call.get('index', 0)}"
            fn = call.get("function") or {}
            if self.block != key:
                out += self._open(key, {"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                                        "name": fn.get("name") or "", "input": {}})
            if isinstance(fn.get("arguments"), str) and fn["arguments"]:
                out += self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.matched = choice.get("matched_stop")
        return out

    def done(self) -> bytes:
        reason, seq = stop_reason(self.finish, self.matched, self.stops)
        u = usage(self.usage)
        return self._close() + sse_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason or "end_turn", "stop_sequence": seq},
            "usage": u}) + sse_event("message_stop", {"type": "message_stop"})

    def error(self, error: dict[str, Any]) -> bytes:
        message = str(error.get("message") or "The upstream failed mid-stream.")
        return sse_event("error", {"type": "error", "error": {"type": stream_error_type(error), "message": message}})
