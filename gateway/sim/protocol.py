"""SGLang's wire shapes: request validation, error envelopes, response bodies and SSE chunks (spec section 2)."""

from __future__ import annotations

import time
from typing import Any

import orjson

# Output text: token j of a completion is WORDS[(base + j * 7919) % len(WORDS)], so text is a pure function
# of (seed, prompt, choice index) and exactly `completion_tokens` words long.
WORDS = [
    " the", " model", " cache", " token", " route", " fast", " node", " prefix", " replica", " and", " of",
    " to", " is", " a", " in", " that", " with", " for", " it", " on", " as", " this", " be", " by", " GPU",
    " batch", " queue", " load", " first", " time", " at", " we",
]


class SimHTTPError(Exception):
    """An error SGLang would answer with its flat envelope."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ("Bad Request" if status == 400 else "BadRequestError")


def error_body(status: int, message: str, type_: str) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": type_, "param": None, "code": status})


def new_id() -> str:
    import uuid

    return uuid.uuid4().hex


def output_text(base: int, start: int, n: int) -> str:
    w = WORDS
    return "".join(w[(base + j * 7919) % len(w)] for j in range(start, start + n))


# -- validation ----------------------------------------------------------------------------------------------
def _int_field(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise SimHTTPError(400, f"1 validation error for request\n{name}\n  Input should be a valid integer")
    if minimum is not None and v < minimum:
        raise SimHTTPError(400, f"{name} must be at least {minimum}, got {v}.", "BadRequestError")
    return v


def validate_common(body: dict[str, Any]) -> tuple[int | None, int, bool]:
    """(max_tokens, n, stream) after SGLang's checks shared by chat and completions."""
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise SimHTTPError(400, "1 validation error for request\nmodel\n  Input should be a valid string")
    if ":" in model:
        adapter = model.split(":", 1)[1]
        raise SimHTTPError(
            400,
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the server with "
            "--enable-lora flag and preload adapters by --lora-paths or /load_lora_adapter endpoint.",
            "BadRequestError",
        )
    n = _int_field(body, "n", 1) or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise SimHTTPError(400, "1 validation error for request\nstream\n  Input should be a valid boolean")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise SimHTTPError(400, f"1 validation error for request\n{name}\n  Input should be a valid number")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise SimHTTPError(400, "1 validation error for request\nstream_options\n  Input should be a valid dictionary")
    return None, n, stream


def validate_chat(body: dict[str, Any]) -> None:
    msgs = body.get("messages")
    if msgs is None:
        raise SimHTTPError(400, "1 validation error for ChatCompletionRequest\nmessages\n  Field required")
    if not isinstance(msgs, list):
        raise SimHTTPError(400, "1 validation error for ChatCompletionRequest\nmessages\n  Input should be a valid list")
    if not msgs:
        raise SimHTTPError(400, "Messages cannot be empty.", "BadRequestError")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.role\n  Field required")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.content\n  Input should be a valid string")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SimHTTPError(400, "1 validation error for ChatCompletionRequest\ntools\n  Input should be a valid list")
    choice = body.get("tool_choice")
    if choice == "required" and not tools:
        raise SimHTTPError(400, "Tool usage requires tools to be provided (tool_choice='required').", "BadRequestError")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        names = {(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)}
        if name not in names:
            raise SimHTTPError(400, f"Tool '{name}' not found in 'tools'.", "BadRequestError")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and not rf.get("json_schema"):
        raise SimHTTPError(400, "response_format.json_schema is required when type is 'json_schema'.", "BadRequestError")


def forced_tool(body: dict[str, Any]) -> str | None:
    """The tool a chat request forces (tool_choice 'required' or a named function), else None."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    if choice == "required" and tools:
        return ((tools[0] or {}).get("function") or {}).get("name")
    return None


# -- bodies --------------------------------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int, cache_report: bool) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cache_report else None,
        "reasoning_tokens": 0,
    }


def tool_call(name: str, idx: int) -> dict[str, Any]:
    return {
        "id": f"call_{idx}",
        "index": idx,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps({"query": "cache"}).decode()},
    }


class ChunkWriter:
    """SSE chunks in one SGLang release's style ("0.5.9": pydantic, all nulls; "0.5.13": fast path)."""

    def __init__(self, rid: str, model: str, style: str, chat: bool) -> None:
        self.rid = rid
        self.model = model
        self.style = style
        self.chat = chat
        self.created = int(time.time())

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    @staticmethod
    def sse(obj: Any) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def chat_delta(self, index: int, delta: dict[str, Any], finish: str | None = None, matched: Any = None) -> bytes:
        if self.style == "0.5.9":
            full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
            full.update(delta)
            delta = full
        else:
            delta = {"reasoning_content": None, **delta}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        obj = {**self._head(), "choices": [choice]}
        if self.style == "0.5.9":
            obj["usage"] = None
        return self.sse(obj)

    def text(self, index: int, text: str, finish: str | None = None, matched: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return self.sse({**self._head(), "choices": [choice]})

    def usage_chunk(self, u: dict[str, Any]) -> bytes:
        if not self.chat:  # completions drop nulls from the usage chunk
            u = {k: v for k, v in u.items() if v is not None}
        return self.sse({**self._head(), "choices": [], "usage": u})

    @staticmethod
    def error(message: str, type_: str, code: int) -> bytes:
        return ChunkWriter.sse({"error": {"object": "error", "message": message, "type": type_, "param": None, "code": code}})

    DONE = b"data: [DONE]\n\n"
