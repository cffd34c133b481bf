"""chat/completions -> Anthropic Messages, pure: the chat answer as a `message` (text and `tool_use` blocks, the
stop reason and the stop sequence that ended it, usage with cache reads), and errors in Anthropic's shape."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.messages.translate import STOP_REASONS, new_id
from gateway.errors import GatewayError


# -- response ------------------------------------------------------------------------------------------------
def parse_arguments(raw: str | None) -> dict[str, Any]:
    try:
        val = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return {"_raw_arguments": raw}  # the engine produced invalid JSON: kept, not lost
    return val if isinstance(val, dict) else {"_value": val}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    u = chat_usage or {}
    details = u.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    prompt = int(u.get("prompt_tokens") or 0)
    return {"input_tokens": max(prompt - cached, 0), "output_tokens": int(u.get("completion_tokens") or 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(finish: str | None, matched: Any, stops: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish == "stop" and isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "", "end_turn" if finish else None), None


def from_chat(chat: dict[str, Any], model: str, stops: list[str] | None) -> dict[str, Any]:
    choices = chat.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if isinstance(msg.get("reasoning_content"), str) and msg["reasoning_content"]:  # the engine's reasoning parser
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if isinstance(msg.get("content"), str) and msg["content"]:
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or new_id("toolu"), "name": fn.get("name") or "",
                        "input": parse_arguments(fn.get("arguments"))})
    reason, seq = stop_reason(choice.get("finish_reason"), choice.get("matched_stop"), stops)
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(chat.get("usage"))}


# -- errors --------------------------------------------------------------------------------------------------
# Anthropic's error types by status (its errors page); any other 4xx is invalid_request_error, any other 5xx api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 504: "timeout_error", 529: "overloaded_error"}


def error_status(status: int) -> int:
    """Anthropic answers 'no capacity' with 529, not 503."""
    return 529 if status == 503 else status


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    status = error_status(status)
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")
    out: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        out["request_id"] = request_id
    return out


def from_gateway_error(err: GatewayError) -> tuple[int, dict[str, Any]]:
    return error_status(err.status), error_body(err.status, err.message)


def stream_error_type(err: dict[str, Any]) -> str:
    """The in-band error event's type for a chat-path error object."""
    overloaded = err.get("type") == "service_unavailable_error" or err.get("code") in ("server_is_overloaded", 503, 529)
    return "overloaded_error" if overloaded else "api_error"
