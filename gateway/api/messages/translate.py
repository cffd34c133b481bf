"""Anthropic Messages API -> chat/completions, pure functions (the way back, and errors: `output.py`).

Request: `system` (string or text blocks) becomes the first system message; each user message's `tool_result`
blocks become `tool` messages (first, in order: they answer the previous assistant turn's calls), its text/image
blocks one user message; an assistant message's `tool_use` blocks become `tool_calls`. Tools map to function
tools (`input_schema` -> `parameters`); tool_choice auto/any/tool/none -> auto/required/function/none;
stop_sequences -> stop; max_tokens (required), temperature, top_p, top_k, metadata.user_id -> user.
`thinking` blocks are dropped from the prompt (the engine's template drops past reasoning) and the `thinking`
request option is ignored. Response: text and tool_use blocks; finish reasons stop -> end_turn (stop_sequence when
a stop sequence matched), length -> max_tokens, tool_calls -> tool_use, content_filter -> refusal; usage counts
`input_tokens` without the cached part, which is `cache_read_input_tokens` (Anthropic's accounting).

What real clients send beyond that (Claude Code, the anthropic SDKs), per Anthropic's own handling: `role: "system"`
entries inside `messages` (mid-conversation system messages) stay where they are, as chat system messages, so the
prefix before them is unchanged and the chat template places them; content blocks of a type this bridge does not
translate (documents, search results, server-tool results...) are left out and reported; tools with `defer_loading`
(shown to the model only through tool search) are left out; server tools (`type` set: web search, code execution,
computer use, ...) and `mcp_servers` are left out or refused per the tenant's `hosted_tools`; `metadata.user_id`
(Claude Code puts device and session ids there) is not sent upstream unless the tenant's `client_metadata` is
`forward`. Each part left out is recorded in the caller's `Dropped` (api/chat_bridge.py).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from gateway.api.dropped import Dropped
from gateway.errors import InvalidRequest
from gateway.tokenizer import count_tokens, render_chat

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal",
                "function_call": "tool_use"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _bad(msg: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


def _text_of(content: Any, where: str) -> str:
    """Text of a system prompt or tool_result content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _bad(f"{where}[{j}]: expected a text block.", f"{where}[{j}]")
            out.append(b["text"])
        return "".join(out)
    if content is None:
        return ""
    raise _bad(f"{where} must be a string or an array of text blocks.", where)


def _system_text(content: Any, where: str, dropped: Dropped) -> str:
    """A `role: "system"` entry's text: a string, or its text blocks (other blocks left out and reported)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks.", where)
    out = []
    for j, b in enumerate(content):
        t = _block_type(b, f"{where}[{j}]")
        if t == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        else:
            dropped.add(f"{where}[{j}]", "unknown_block")
    return "".join(out)


def _block_type(b: Any, where: str) -> str:
    """A content block's type; a block that is not an object with a string type is refused (as Anthropic does)."""
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise _bad(f"{where}: a content block must be an object with a string 'type'.", f"{where}.type")
    t: str = b["type"]
    return t


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source: an object is required (a base64 or url image source).", f"{where}.source")
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _bad(f"{where}.source must be a base64 or url image source.", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_text(inner: Any, where: str, dropped: Dropped) -> str:
    """A tool_result's content as text: a string, or its text blocks (images and other blocks left out)."""
    if inner is None or isinstance(inner, str):
        return inner or ""
    if not isinstance(inner, list):
        raise _bad(f"{where} must be a string or an array of content blocks.", where)
    out = []
    for j, x in enumerate(inner):
        if _block_type(x, f"{where}[{j}]") == "text" and isinstance(x.get("text"), str):
            out.append(x["text"])
        else:
            dropped.add(f"{where}[{j}]", "unknown_block")
    return "".join(out)


IMAGE_LEFT_OUT = "[an image was attached here; this model does not take image input]"


def _user_messages(content: Any, where: str, dropped: Dropped, images: bool = True) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks.", where)
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        w = f"{where}[{j}]"
        t = _block_type(b, w)
        if t == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif t == "image":
            part = _image_part(b, w)  # checked either way: a malformed image is the client's 400 whatever the model
            if images:
                parts.append(part)
            else:  # the model reads a note where the image was, so the turn still makes sense to it
                dropped.add(w, "image")
                parts.append({"type": "text", "text": IMAGE_LEFT_OUT})
        elif t == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{w}.tool_use_id must be a string.", f"{w}.tool_use_id")
            text = _tool_result_text(b.get("content"), f"{w}.content", dropped)
            if b.get("is_error"):
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif t in ("thinking", "redacted_thinking"):
            continue  # past reasoning: the engine's template drops it too
        else:
            dropped.add(w, "unknown_block")
    out = list(tools)
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return out


def _assistant_message(content: Any, where: str, dropped: Dropped) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks.", where)
    text, calls = [], []
    for j, b in enumerate(content):
        w = f"{where}[{j}]"
        t = _block_type(b, w)
        if t == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif t == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(f"{w}: tool_use needs a string 'id' and 'name'.", w)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": orjson.dumps(b.get("input") or {}).decode()}})
        elif t in ("thinking", "redacted_thinking"):
            continue
        else:
            dropped.add(w, "unknown_block")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


BILLING_HEADER = "x-anthropic-billing-header:"


def _client_blocks(system: Any, dropped: Dropped) -> Any:
    """`system` without Claude Code's attribution block (`x-anthropic-billing-header: cc_version=...; cch=...`):
    metadata about the client, not instructions; Anthropic reads it as a header. Its checksum changes on every
    request, so left in the prompt it would end the cached prefix a few tokens in."""
    if not isinstance(system, list):
        return system
    kept = []
    for j, b in enumerate(system):
        if isinstance(b, dict) and isinstance(b.get("text"), str) and b["text"].startswith(BILLING_HEADER):
            dropped.add(f"system[{j}]", "client_metadata")
        else:
            kept.append(b)
    return kept


def chat_messages(body: dict[str, Any], dropped: Dropped | None = None,
                  client_metadata: str = "strip", images: bool = True) -> list[dict[str, Any]]:
    dropped = dropped if dropped is not None else Dropped()
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: at least one message is required.", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if client_metadata != "forward":
        system = _client_blocks(system, dropped)
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    turns = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role must be 'user', 'assistant' or 'system'.", f"{where}.role")
        assert isinstance(m, dict)
        if role == "system":  # a mid-conversation system message: in place, so the prefix before it is unchanged
            text = _system_text(m.get("content"), f"{where}.content", dropped)
            if text:
                out.append({"role": "system", "content": text})
        elif role == "user":
            turns += 1
            out.extend(_user_messages(m.get("content"), f"{where}.content", dropped, images))
        else:
            turns += 1
            out.append(_assistant_message(m.get("content"), f"{where}.content", dropped))
    if not turns:
        raise _bad("messages: at least one user or assistant message is required.", "messages")
    return out


def chat_tools(tools: Any, dropped: Dropped | None = None, hosted_tools: str = "drop") -> list[dict[str, Any]] | None:
    """Client tools as chat function tools. Server tools (a `type` other than custom) run on the provider's side:
    left out (`hosted_tools: drop`) or refused (`refuse`); `defer_loading` tools are left out (only tool search
    would show them to the model)."""
    dropped = dropped if dropped is not None else Dropped()
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be an array.", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{i}].name: a non-empty string is required.", f"tools[{i}].name")
        if t.get("type") not in (None, "custom"):
            if hosted_tools == "refuse" or not isinstance(t.get("type"), str):
                raise _bad(f"tools[{i}]: server tools of type {t.get('type')!r} are not supported by this gateway.",
                           f"tools[{i}].type")
            dropped.add(f"tools[{i}]", "hosted_tool")
            continue
        if t.get("defer_loading") is True:
            dropped.add(f"tools[{i}]", "deferred_tool")
            continue
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{i}].input_schema: an object is required.", f"tools[{i}].input_schema")
        fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: Any, has_tools: bool) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) for an Anthropic tool_choice."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type must be one of auto, any, tool, none.", "tool_choice.type")
    if choice["type"] != "none" and not has_tools:
        raise _bad("tool_choice requires tools.", "tool_choice")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name: a string is required for type 'tool'.", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _num(body: dict[str, Any], name: str, lo: float, hi: float | None) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo or (hi is not None and v > hi):
        raise _bad(f"{name}: must be a number " + (f"between {lo:g} and {hi:g}." if hi is not None else f">= {lo:g}."),
                   name)
    return v


def _named_tool(choice: Any) -> str | None:
    return choice.get("name") if isinstance(choice, dict) and choice.get("type") == "tool" else None


def to_chat(body: dict[str, Any], *, count_only: bool = False, dropped: Dropped | None = None,
            hosted_tools: str = "drop", client_metadata: str = "strip", images: bool = True) -> dict[str, Any]:
    """The chat body for a Messages request (`count_only`: count_tokens, where max_tokens is not required).
    `dropped` collects what is left out; `hosted_tools` and `client_metadata` are the tenant's policy; `images`
    false (a model configured `vision: false`) leaves image blocks out, each named in `dropped`."""
    dropped = dropped if dropped is not None else Dropped()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: a non-empty string is required.", "model")
    max_tokens = body.get("max_tokens")
    if not count_only and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad("max_tokens: an integer >= 1 is required.", "max_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream: must be a boolean.", "stream")
    if body.get("mcp_servers"):  # Anthropic's MCP connector: servers the provider calls
        if hosted_tools == "refuse":
            raise _bad("mcp_servers: MCP servers called by the provider are not supported by this gateway.",
                       "mcp_servers")
        dropped.add("mcp_servers", "hosted_tool")
    raw_tools = body.get("tools")
    tools = chat_tools(raw_tools, dropped, hosted_tools)
    raw_choice = body.get("tool_choice")
    named = _named_tool(raw_choice)
    offered = {t["function"]["name"] for t in tools or []}
    if raw_choice is not None and raw_tools and (not tools or (named is not None and named not in offered)):
        dropped.add("tool_choice", "tool_choice")  # it names (or needs) a tool that was left out
        raw_choice = None
    choice, parallel = chat_tool_choice(raw_choice, bool(tools))
    chat: dict[str, Any] = {"model": model, "messages": chat_messages(body, dropped, client_metadata, images)}
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    if count_only:
        return chat
    chat.update(max_tokens=max_tokens, stream=stream)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences: must be an array of non-empty strings.", "stop_sequences")
        if stops:
            chat["stop"] = stops
    for name, lo, hi in (("temperature", 0, 1), ("top_p", 0, 1), ("top_k", 0, None)):
        v = _num(body, name, lo, hi)
        if v is not None:
            chat[name] = v
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        if client_metadata == "forward":
            chat["user"] = meta["user_id"]
        else:
            dropped.add("metadata.user_id", "client_metadata")
    return chat


def input_tokens(chat: dict[str, Any]) -> int:
    """`message_start`'s estimate of a prompt (the shared 4-characters-per-token rule, see gateway/tokenizer.py):
    cheap on every streamed request; count_tokens uses the model's tokenizer where one is loaded (tokenizers/)."""
    return count_tokens(render_chat(chat["messages"], chat.get("tools")))


