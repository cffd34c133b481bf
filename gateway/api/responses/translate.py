"""Responses API -> chat/completions, pure functions (no I/O, no clock unless given). The tools' side is
`tools.py`; the way back (chat answer -> Responses output) is `output.py`.

Request: `instructions` + stored history (previous_response_id) + `input` become one chat `messages` list, built by
`items_to_messages` from Responses items in their order, so the chat path hashes the same prefix a chat client
would have sent and turn N+1 lands on the replica that holds turn N. Response: the chat answer becomes `output`
items (an assistant `message`, `function_call`s) and `usage` with `input_tokens_details.cached_tokens`.

Supported: string or item-list input (messages with input_text / output_text / input_image parts, function_call,
function_call_output, custom_tool_call(_output); reasoning items are dropped from the prompt), function, custom and
namespace tools and tool_choice, max_output_tokens, temperature, top_p, text.format (text / json_object /
json_schema), metadata, store, truncation (`auto` drops the oldest turns past `responses.auto_truncate_input_tokens`),
parallel_tool_calls. Refused with a 400 naming the field: background, conversation, prompt templates. Other unknown
top-level fields pass through to the chat body (e.g. SGLang's `ignore_eos`), like the chat path passes them
upstream. `reasoning.effort` is sent as the route's pools take it (reasoning.py) and echoed as the client sent it.

What agents send beyond that (Codex CLI, the Agents SDK), handled as OpenAI does where a pool can: hosted tools
(web_search, file_search, code_interpreter, computer use, MCP, image generation, shell/apply_patch built-ins...)
are left out or refused per the tenant's `hosted_tools`; a namespace's tools become chat functions named
`<namespace>__<name>` and calls come back with their `namespace`; a custom (free-form) tool becomes a function taking
one string `input`, its calls come back as `custom_tool_call`s; input items and content parts of types the bridge
does not translate are left out (OpenAI ignores item types it does not run, e.g. a web_search_call); a
`function_call_output` without `call_id` answers the latest call still unanswered, else it is left out; `user`,
`safety_identifier` and Codex's `client_metadata` are not sent upstream unless the tenant's `client_metadata` is
`forward`. What is left out is recorded in the caller's `Dropped` (api/dropped.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api.dropped import Dropped
from gateway.api.responses.reasoning import chat_fields, effort_of
from gateway.api.responses.tools import NS_SEP, ToolName, additional_tools, chat_tool_choice, chat_tools, choice_of
from gateway.errors import InvalidRequest
from gateway.tokenizer import CHARS_PER_TOKEN, GENERATION_PROMPT, render_head, render_message

# Responses fields the bridge reads; anything else not in UNSUPPORTED passes through to the chat body.
KNOWN = {"model", "input", "instructions", "previous_response_id", "store", "stream", "tools", "tool_choice",
         "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "text", "reasoning", "metadata",
         "truncation", "user", "include", "service_tier", "stream_options", "safety_identifier", "prompt_cache_key",
         "max_tool_calls", "top_logprobs", "client_metadata"}
# Fields that identify the client's user, installation or session: sent upstream only with `client_metadata: forward`
CLIENT_FIELDS = ("user", "safety_identifier", "client_metadata")
UNSUPPORTED = {"background": "background responses are not supported by this gateway",
               "conversation": "conversations are not supported; chain turns with previous_response_id",
               "prompt": "prompt templates are not supported; send instructions and input"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the chat body to send, and what the Response object echoes."""

    chat: dict[str, Any]
    model: str
    stream: bool
    store: bool
    input_items: list[dict[str, Any]]  # this request's input, normalized, with ids (for input_items and history)
    echo: dict[str, Any]  # request fields the Response object reports back
    tool_names: dict[str, ToolName] | None = None  # chat function name -> the tool it stands for (namespace, custom)


def _bad(msg: str, param: str) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{name}' must be a number between {lo:g} and {hi:g}.", name)
    return v


# -- input items ---------------------------------------------------------------------------------------------
def _call_item(item: dict[str, Any], where: str, kind: str) -> dict[str, Any]:
    """A function_call / custom_tool_call input item (a call the model made in an earlier turn)."""
    payload = "arguments" if kind == "function_call" else "input"
    for f in ("name", payload):
        if not isinstance(item.get(f), str):
            raise _bad(f"{where}.{f} must be a string.", f"{where}.{f}")
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        call_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else new_id("call")
    out = {"type": kind, "id": item.get("id") or new_id("fc" if kind == "function_call" else "ctc"),
           "call_id": call_id, "name": item["name"], payload: item[payload], "status": "completed"}
    if isinstance(item.get("namespace"), str) and item["namespace"]:
        out["namespace"] = item["namespace"]
    return out


def _output_item(item: dict[str, Any], where: str, kind: str, pending: list[str],
                 dropped: Dropped) -> dict[str, Any] | None:
    """A function_call_output / custom_tool_call_output. Without a call_id it answers the latest call still
    unanswered (how OpenAI reads it); with none left it is left out."""
    output = item.get("output")
    if not isinstance(output, (str, list)):
        raise _bad(f"{where}.output must be a string or an array of content parts.", f"{where}.output")
    call_id = item.get("call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise _bad(f"{where}.call_id must be a string.", f"{where}.call_id")
    if not call_id:
        if not pending:
            dropped.add(where, "unknown_item")
            return None
        call_id = pending[-1]
    if call_id in pending:
        pending.remove(call_id)
    return {"type": kind, "id": item.get("id") or new_id("fco"), "call_id": call_id, "output": output,
            "status": "completed"}


def normalize_input(raw: Any, allow_empty: bool = False, dropped: Dropped | None = None,
                    pending: list[str] | None = None) -> list[dict[str, Any]]:
    """The request's `input` as a list of typed items with ids (a string is one user message). `pending`: the
    call ids of the history's calls still unanswered (an output without call_id answers the latest)."""
    dropped = dropped if dropped is not None else Dropped()
    pending = list(pending or [])
    if isinstance(raw, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list):
        raise _bad("'input' must be a string or an array of input items.", "input")
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message_item(item, where, dropped))
        elif kind in ("function_call", "custom_tool_call"):
            call = _call_item(item, where, kind)
            pending.append(call["call_id"])
            out.append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            answered = _output_item(item, where, kind, pending, dropped)
            if answered is not None:
                out.append(answered)
        elif kind == "reasoning":
            out.append({k: v for k, v in item.items()})  # kept in history, dropped from the prompt
        elif kind == "additional_tools":  # tools declared in the conversation (Codex's default): chat tools
            if not isinstance(item.get("tools"), list):
                raise _bad(f"{where}.tools must be an array.", f"{where}.tools")
            out.append({"type": "additional_tools", "id": item.get("id") or new_id("at"), "tools": item["tools"]})
        elif isinstance(kind, str):
            dropped.add(f"{where}", "unknown_item")  # e.g. a hosted tool's call item, an item_reference
        else:
            raise _bad(f"{where}.type must be a string.", f"{where}.type")
    if not out and not allow_empty:
        raise _bad("'input' must not be empty.", "input")
    return out


def pending_calls(items: list[dict[str, Any]]) -> list[str]:
    """Call ids of the calls in `items` no output answers yet, in order."""
    pending: list[str] = []
    for it in items:
        if it.get("type") in ("function_call", "custom_tool_call"):
            pending.append(it.get("call_id") or "")
        elif it.get("type") in ("function_call_output", "custom_tool_call_output") and it.get("call_id") in pending:
            pending.remove(it["call_id"])
    return [c for c in pending if c]


def _message_item(item: dict[str, Any], where: str, dropped: Dropped | None = None) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _bad(f"{where}.role must be one of user, assistant, system, developer.", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            t = p.get("type") if isinstance(p, dict) else None
            if t in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
                parts.append({"type": "output_text" if role == "assistant" else "input_text", "text": p["text"]})
            elif t == "refusal" and isinstance(p.get("refusal"), str):
                parts.append({"type": "refusal", "refusal": p["refusal"]})
            elif t == "input_image" and isinstance(p.get("image_url"), str):
                parts.append({"type": "input_image", "image_url": p["image_url"], "detail": p.get("detail", "auto")})
            elif isinstance(t, str) and dropped is not None:
                dropped.add(f"{where}.content[{j}]", "unknown_block")  # e.g. input_file, an image by file_id
            else:
                raise _bad(f"{where}.content[{j}]: content parts of type {t!r} are not supported "
                           "(supported: input_text, output_text, refusal, input_image with image_url).",
                           f"{where}.content[{j}].type")
    else:
        raise _bad(f"{where}.content must be a string or an array of content parts.", f"{where}.content")
    msg = {"type": "message", "id": item.get("id") or new_id("msg"), "role": role, "content": parts}
    if role == "assistant":
        msg["status"] = "completed"
    return msg


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    texts = [p.get("text") or p.get("refusal") or "" for p in parts if p["type"] != "input_image"]
    if len(texts) == len(parts):
        return "".join(texts)  # all text: one string, exactly what a chat client sends
    return [{"type": "image_url", "image_url": {"url": p["image_url"]}} if p["type"] == "input_image"
            else {"type": "text", "text": p.get("text") or p.get("refusal") or ""} for p in parts]


def _output_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "".join(p.get("text", "") for p in value if isinstance(p, dict))


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for Responses items, in order. An assistant message followed by function calls (one model
    turn) becomes one assistant message with `tool_calls`, as a chat client would have sent it."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _chat_content(item["content"])})
        elif kind in ("function_call", "custom_tool_call"):
            name = f"{item['namespace']}{NS_SEP}{item['name']}" if item.get("namespace") else item["name"]
            args = item["arguments"] if kind == "function_call" else orjson.dumps({"input": item["input"]}).decode()
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _output_text(item["output"])})
        # reasoning items: the engine's template drops past reasoning from the prompt, so does the bridge
    return out


def truncate(messages: list[dict[str, Any]], tools: list[Any] | None, limit: int) -> list[dict[str, Any]]:
    """`truncation: auto`: drop the oldest non-system messages (and tool results they leave orphaned) until the
    rendered prompt fits `limit` tokens; the last message is always kept.

    Each message is rendered and measured once: the rendering is a concatenation of independent parts
    (gateway/tokenizer.py), so the prompt without the first `i` messages is as long as the whole minus their parts
    (suffix sums). Re-rendering the prompt after every dropped message made 10,000 messages take ~26 s of CPU."""
    system = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    fixed = len(render_head(tools)) + len(GENERATION_PROMPT) + sum(len(render_message(m)) for m in system)
    lengths = [len(render_message(m)) for m in rest]
    kept = fixed + sum(lengths)  # characters of the prompt rendered with rest[start:]
    start = 0
    while len(rest) - start > 1 and -(-kept // CHARS_PER_TOKEN) > limit:
        kept -= lengths[start]
        start += 1
        while len(rest) - start > 1 and rest[start]["role"] == "tool":
            kept -= lengths[start]
            start += 1
    return system + rest[start:]


def chat_response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object.", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format of type json_schema needs a string 'name' and an object 'schema'.", "text.format")
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": js}
    raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'.", "text.format.type")


# -- request -------------------------------------------------------------------------------------------------
def parse_request(body: dict[str, Any], history: list[dict[str, Any]], auto_truncate_tokens: int,
                  allow_empty_input: bool = False, pool_kinds: frozenset[str] = frozenset(),
                  dropped: Dropped | None = None, hosted_tools: str = "drop",
                  client_metadata: str = "strip") -> ResponsesRequest:
    """`history`: the stored items of the previous_response_id chain (its input items then its output);
    `pool_kinds`: the kinds of the pools that may serve it (how `reasoning` is sent, see reasoning.py);
    `dropped` collects what is left out; `hosted_tools` and `client_metadata` are the tenant's policy."""
    dropped = dropped if dropped is not None else Dropped()
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None and body.get(name) is not False:
            raise _bad(f"'{name}': {why}.", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a non-empty string.", "model")
    if "input" not in body:
        raise _bad("'input' is required.", "input")
    stream = body.get("stream") or False
    store = body.get("store", True)
    for name, v in (("stream", stream), ("store", store)):
        if not isinstance(v, bool):
            raise _bad(f"'{name}' must be a boolean.", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string.", "instructions")
    max_out = body.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1):
        raise _bad("'max_output_tokens' must be an integer >= 1.", "max_output_tokens")
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise _bad("'truncation' must be 'auto' or 'disabled'.", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or
                                 not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise _bad("'metadata' must be an object of at most 16 string values.", "metadata")
    reasoning = body.get("reasoning")
    effort = effort_of(reasoning)
    input_items = normalize_input(body["input"], allow_empty_input, dropped, pending_calls(history))
    names: dict[str, ToolName] = {}
    declared = list(body.get("tools") or []) if isinstance(body.get("tools"), list) else body.get("tools")
    tools = chat_tools(declared, dropped, hosted_tools, names)
    extra = additional_tools(history + input_items, dropped, hosted_tools, names)
    if extra:
        known = {t["function"]["name"] for t in tools or []}
        tools = (tools or []) + [t for t in extra if t["function"]["name"] not in known]
    tool_choice = chat_tool_choice(choice_of(body.get("tool_choice"), tools, body.get("tools"), dropped))
    if tool_choice not in (None, "auto", "none") and not tools:
        raise _bad("'tool_choice' requires 'tools'.", "tool_choice")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        items_to_messages(history + input_items)
    if truncation == "auto":
        messages = truncate(messages, tools, auto_truncate_tokens)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in KNOWN}  # pass-through (e.g. ignore_eos)
    for name in CLIENT_FIELDS:
        if body.get(name) is not None:
            if client_metadata == "forward":
                chat[name] = body[name]
            else:
                dropped.add(name, "client_metadata")
    chat.update(model=model, messages=messages, stream=stream)
    if stream:
        chat["stream_options"] = {"include_usage": True}  # the bridge needs usage for the final event
    if tools:
        chat["tools"] = tools
    if tool_choice is not None and tools:
        chat["tool_choice"] = tool_choice
    if body.get("parallel_tool_calls") is not None and tools:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    fmt = chat_response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    chat.update(chat_fields(effort, pool_kinds, chat))
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {}
    echo = {
        "instructions": instructions, "max_output_tokens": max_out, "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": body.get("previous_response_id"),
        "reasoning": reasoning or {"effort": None, "summary": None}, "store": store,
        "temperature": temperature if temperature is not None else 1.0, "top_p": top_p if top_p is not None else 1.0,
        "text": {"format": text.get("format") or {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "truncation": truncation, "user": body.get("user"),
    }
    return ResponsesRequest(chat, model, stream, store, input_items, echo, names or None)


