"""Tools reach the chat template as SGLang 0.5.23 hands them over (its request model's dump: the client's keys, then
the left-out fields as null), so a request with tools gets the engine's own token ids. The expected texts are what
a real 0.5.23 server's /v1/tokenize rendered for these tools (tests/engines checks the ids against it live)."""

from __future__ import annotations

import json

from gateway.tokenizers.real import engine_tools


def test_left_out_fields_are_rendered_as_null_after_the_clients() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
             {"type": "function", "function": {"name": "g"}}]
    got = [json.dumps(t, ensure_ascii=False) for t in engine_tools(tools) or []]
    assert got == [
        '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": true, '
        '"description": null}, "defer_loading": null}',
        '{"type": "function", "function": {"name": "g", "description": null, "parameters": null}, '
        '"defer_loading": null}']
    assert tools[1] == {"type": "function", "function": {"name": "g"}}  # the request body is left as sent


def test_no_tools_and_odd_entries() -> None:
    assert engine_tools(None) is None and engine_tools([]) is None
    assert engine_tools([{"type": "web_search"}]) == [{"type": "web_search"}]
