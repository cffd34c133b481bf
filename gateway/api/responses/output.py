"""chat/completions -> Responses, pure: the chat answer becomes `output` items (an assistant `message`,
`function_call` and `custom_tool_call` items named as the client declared them) and `usage` with
`input_tokens_details.cached_tokens`; the response object; a stored turn's history."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.responses.tools import ToolName, tool_name
from gateway.api.responses.translate import ResponsesRequest, new_id


# -- response ------------------------------------------------------------------------------------------------
def usage_from_chat(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    reasoning = out_details.get("reasoning_tokens") if isinstance(out_details, dict) else None
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": int((details or {}).get("cached_tokens") or 0)},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": int(reasoning or usage.get("reasoning_tokens") or 0)},
            "total_tokens": int(usage.get("total_tokens") or prompt + completion)}


def status_for(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) for a chat finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def custom_input(arguments: str) -> str:
    """A custom tool's input from the chat call's arguments (`{"input": ...}`; anything else is passed as it is)."""
    try:
        val = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return arguments
    return val["input"] if isinstance(val, dict) and isinstance(val.get("input"), str) else arguments


def function_call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed",
                       names: dict[str, ToolName] | None = None) -> dict[str, Any]:
    """The Responses item for a chat tool call: a function_call (with its namespace when it has one), or a
    custom_tool_call for a custom tool."""
    fn = call.get("function") or {}
    tool = tool_name(fn.get("name") or "", names)
    args = fn.get("arguments") or ""
    if tool.custom:
        out = {"type": "custom_tool_call", "id": item_id or new_id("ctc"), "call_id": call.get("id") or new_id("call"),
               "name": tool.name, "input": custom_input(args) if status == "completed" else "", "status": status}
    else:
        out = {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.get("id") or new_id("call"),
               "name": tool.name, "arguments": args, "status": status}
    if tool.namespace:
        out["namespace"] = tool.namespace
    return out


def output_from_chat(choice: dict[str, Any], names: dict[str, ToolName] | None = None) -> list[dict[str, Any]]:
    msg = choice.get("message") or {}
    out = []
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})
    text = msg.get("content")
    if isinstance(text, str) and (text or not msg.get("tool_calls")):
        out.append(message_item(text))
    for call in msg.get("tool_calls") or []:
        if isinstance(call, dict):
            out.append(function_call_item(call, names=names))
    return out


def response_object(resp_id: str, created_at: int, req: ResponsesRequest, *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, incomplete: dict[str, str] | None = None,
                    error: dict[str, Any] | None = None, completed_at: int | None = None) -> dict[str, Any]:
    return {"id": resp_id, "object": "response", "created_at": created_at, "status": status,
            "completed_at": completed_at if status == "completed" else None, "error": error,
            "incomplete_details": incomplete, "model": req.model, "output": output, "usage": usage,
            "background": False, "service_tier": "default", **req.echo}


def from_chat(chat: dict[str, Any], resp_id: str, created_at: int, now: int, req: ResponsesRequest) -> dict[str, Any]:
    choices = chat.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    status, incomplete = status_for(choice.get("finish_reason"))
    return response_object(resp_id, created_at, req, status=status, output=output_from_chat(choice, req.tool_names),
                           usage=usage_from_chat(chat.get("usage")), incomplete=incomplete, completed_at=now)


def history_of(stored: dict[str, Any]) -> list[dict[str, Any]]:
    """The items a follow-up turn continues from: the stored turn's whole input (its own history included) and
    its output, in order."""
    return list(stored["input_items"]) + list(stored["response"].get("output") or [])


def error_code(err: dict[str, Any]) -> str:
    code = err.get("code")
    return "rate_limit_exceeded" if code in ("rate_limit_exceeded", 429, "429") else "server_error"
