"""Chat chunks -> the Responses stream: `response.created`, `response.in_progress`, per output item
`response.output_item.added` (+ `response.content_part.added`, `response.output_text.delta`... or
`response.function_call_arguments.delta`...) and its `.done` events, then `response.completed` (or
`response.incomplete` when max_output_tokens cut it). An upstream failure after the stream began ends with an
`error` event and `response.failed`. Every event carries a `sequence_number` from 0."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.api.chat_bridge import first_choice, sse_event
from gateway.api.responses.output import (
    custom_input,
    error_code,
    function_call_item,
    message_item,
    response_object,
    status_for,
    usage_from_chat,
)
from gateway.api.responses.translate import ResponsesRequest, new_id


class ResponsesStream:
    def __init__(self, resp_id: str, req: ResponsesRequest, clock: Callable[[], float] = time.time) -> None:
        self.resp_id = resp_id
        self.req = req
        self.clock = clock
        self.created_at = int(clock())
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self.items: dict[int, dict[str, Any]] = {}  # output_index -> finished item
        self.text: dict[str, Any] | None = None  # the open message item: {"item", "index", "buf"}
        self.thought: dict[str, Any] | None = None  # the open reasoning item (engine `reasoning_content`), same shape
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> open function_call item state
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None  # the finished Response object (for the store)
        self._next_index = 0

    def _ev(self, event: str, /, **data: Any) -> bytes:
        out = sse_event(event, {"type": event, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.resp_id, self.created_at, self.req, status=status, output=list(self.output),
                               usage=kw.pop("usage", None), **kw)

    # -- StreamEncoder ---------------------------------------------------------------------------------------
    def start(self) -> bytes:
        snap = self._snapshot("in_progress")
        return self._ev("response.created", response=snap) + self._ev("response.in_progress", response=snap)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage_from_chat(chunk["usage"])
        first = first_choice(chunk)
        if first is None:
            return b""
        choice, delta = first
        out = b""
        thought = delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            out += self._reasoning_delta(thought)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._close_reasoning() + self._text_delta(text)
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                out += self._call_delta(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out

    def done(self) -> bytes:
        out = self._close_all()
        status, incomplete = status_for(self.finish_reason)
        self.final = self._snapshot(status, usage=self.usage, incomplete=incomplete, completed_at=int(self.clock()))
        return out + self._ev("response.completed" if status == "completed" else "response.incomplete", response=self.final)

    def error(self, error: dict[str, Any]) -> bytes:
        message = str(error.get("message") or "The upstream failed mid-stream.")
        code = error_code(error)
        out = self._ev("error", code=code, message=message, param=None)
        self.final = self._snapshot("failed", usage=self.usage, error={"code": code, "message": message})
        return out + self._ev("response.failed", response=self.final)

    # -- items -----------------------------------------------------------------------------------------------
    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self.text is None:
            item = message_item("", new_id("msg"), status="in_progress")
            item["content"] = []
            self.text = {"item": item, "index": self._next_index, "buf": []}
            self._next_index += 1
            out += self._ev("response.output_item.added", output_index=self.text["index"], item=item)
            out += self._ev("response.content_part.added", item_id=item["id"], output_index=self.text["index"],
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.text["buf"].append(text)
        return out + self._ev("response.output_text.delta", item_id=self.text["item"]["id"],
                              output_index=self.text["index"], content_index=0, delta=text, logprobs=[])

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        idx = call.get("index", 0)
        fn = call.get("function") or {}
        out = b""
        st = self.calls.get(idx)
        if st is None:
            out += self._close_reasoning() + self._close_text()  # a turn's thinking and text precede its calls
            item = function_call_item({"id": call.get("id"), "function": {"name": fn.get("name"), "arguments": ""}},
                                      new_id("fc"), status="in_progress", names=self.req.tool_names)
            st = self.calls[idx] = {"item": item, "index": self._next_index, "buf": [], "open": True}
            self._next_index += 1
            out += self._ev("response.output_item.added", output_index=st["index"], item=item)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            st["buf"].append(args)
            if st["item"]["type"] == "function_call":  # a custom tool's input is whole only once its JSON is
                out += self._ev("response.function_call_arguments.delta", item_id=st["item"]["id"],
                                output_index=st["index"], delta=args)
        return out

    def _reasoning_delta(self, text: str) -> bytes:
        out = b""
        if self.thought is None:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            self.thought = {"item": item, "index": self._next_index, "buf": []}
            self._next_index += 1
            out += self._ev("response.output_item.added", output_index=self.thought["index"], item=item)
        self.thought["buf"].append(text)
        return out + self._ev("response.reasoning_text.delta", item_id=self.thought["item"]["id"],
                              output_index=self.thought["index"], content_index=0, delta=text)

    def _close_reasoning(self) -> bytes:
        if self.thought is None:
            return b""
        t, self.thought = self.thought, None
        full = "".join(t["buf"])
        item = {"type": "reasoning", "id": t["item"]["id"], "summary": [],
                "content": [{"type": "reasoning_text", "text": full}], "status": "completed"}
        out = self._ev("response.reasoning_text.done", item_id=item["id"], output_index=t["index"], content_index=0,
                       text=full)
        out += self._ev("response.output_item.done", output_index=t["index"], item=item)
        self._place(t["index"], item)
        return out

    def _close_text(self) -> bytes:
        if self.text is None:
            return b""
        t, self.text = self.text, None
        full = "".join(t["buf"])
        item = message_item(full, t["item"]["id"])
        part = item["content"][0]
        out = self._ev("response.output_text.done", item_id=item["id"], output_index=t["index"], content_index=0,
                       text=full, logprobs=[])
        out += self._ev("response.content_part.done", item_id=item["id"], output_index=t["index"], content_index=0,
                        part=part)
        out += self._ev("response.output_item.done", output_index=t["index"], item=item)
        self._place(t["index"], item)
        return out

    def _close_all(self) -> bytes:
        out = self._close_reasoning() + self._close_text()
        for st in sorted(self.calls.values(), key=lambda s: s["index"]):
            if not st["open"]:
                continue
            st["open"] = False
            if st["item"]["type"] == "custom_tool_call":
                item = dict(st["item"], input=custom_input("".join(st["buf"])), status="completed")
                out += self._ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=st["index"],
                                delta=item["input"])
                out += self._ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=st["index"],
                                input=item["input"])
            else:
                item = dict(st["item"], arguments="".join(st["buf"]), status="completed")
                out += self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=st["index"],
                                name=item["name"], arguments=item["arguments"])
            out += self._ev("response.output_item.done", output_index=st["index"], item=item)
            self._place(st["index"], item)
        return out

    def _place(self, index: int, item: dict[str, Any]) -> None:
        self.items[index] = item
        self.output = [self.items[i] for i in sorted(self.items)]
