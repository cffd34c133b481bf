"""Request parsing and the checks the gateway itself makes (the upstream validates the rest).

Unknown fields pass through untouched; only fields the gateway reads are type-checked, so a bad value becomes a
400 with `param` set instead of an upstream surprise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.tokenizer import count_tokens, prompt_text, render_chat


@dataclass(frozen=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_output_tokens: int | None


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidRequest(f"'{name}' must be an integer >= {minimum}.", param=name)
    return v


def validate(body: dict[str, Any], endpoint: str) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string.", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    if so is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    include_usage = bool(so and so.get("include_usage"))
    _opt_int(body, "n", 1)
    max_out = _opt_int(body, "max_completion_tokens", 1) if endpoint == "chat/completions" else None
    if max_out is None:
        max_out = _opt_int(body, "max_tokens", 1)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidRequest(f"'{name}' must be a number.", param=name)
    if endpoint == "chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'.", param=f"messages[{i}].role")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise InvalidRequest(f"messages[{i}].content must be a string or an array of parts.", param=f"messages[{i}].content")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array.", param="tools")
        prompt_tokens = count_tokens(render_chat(msgs, tools))
    else:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise InvalidRequest("'prompt' is required and must not be empty.", param="prompt")
        text = prompt_text(prompt)
        if text is not None:
            prompt_tokens = count_tokens(text)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_tokens = len(prompt)
        elif isinstance(prompt, list) and all(isinstance(p, list) for p in prompt):
            prompt_tokens = sum(len(p) for p in prompt)
        else:
            raise InvalidRequest("'prompt' must be a string, an array of strings, or token ids.", param="prompt")
    return ParsedRequest(body, model, stream, include_usage, prompt_tokens, max_out)
