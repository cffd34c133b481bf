"""The Messages bridge's pure parts: request -> chat body, chat answer -> Message, chat chunks -> the Messages
event sequence, error shapes."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.dropped import Dropped
from gateway.api.messages.output import error_body, error_status, from_chat, stop_reason
from gateway.api.messages.stream import MessagesStream
from gateway.api.messages.translate import to_chat
from gateway.errors import InvalidRequest


def events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            ev = orjson.loads(data[len(b"data: "):])
            assert name == b"event: " + ev["type"].encode()
            out.append(ev)
    return out


def test_system_blocks_tool_use_and_tool_results_map_to_chat_turns():
    body = {"model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                             {"type": "text", "text": "and tomorrow?"}]}],
            "tools": [{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 40, "metadata": {"user_id": "u1"}}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                               "description": "weather"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["top_k"] == 40 and chat["max_tokens"] == 10
    assert "user" not in chat  # client-identifying: stripped unless the tenant forwards it
    assert to_chat(body, client_metadata="forward")["user"] == "u1"


def test_what_claude_code_sends_is_served_and_what_is_left_out_is_reported():
    """Claude Code (2.1.154+) puts a system entry inside messages[], marks tools deferred, may send server tools
    and unknown blocks: the turn is served, the system entry stays in place (the prefix before it unchanged), and
    every part left out is named with its reason."""
    body = {"model": "claude-sonnet", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.153.cd9; cch=2df54;"},
                       {"type": "text", "text": "base", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Read calc.py"},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment"},
                                                        {"type": "image_ref", "x": 1}]},
                         {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search"},
                                                           {"type": "text", "text": "ok"}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                       "content": [{"type": "text", "text": "a"},
                                                                   {"type": "image", "source": {}}]},
                                                      {"type": "search_result", "title": "x"}]}],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                      {"name": "DeferredToolPlaceholder", "input_schema": {"type": "object"}, "defer_loading": True},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "web_search"},
            "metadata": {"user_id": "{\"device_id\": \"d\"}"}, "thinking": {"type": "adaptive"},
            "context_management": {"edits": []}, "output_config": {"effort": "high"}}
    dropped = Dropped()
    chat = to_chat(body, dropped=dropped)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system", "assistant", "tool"]
    assert chat["messages"][2] == {"role": "system", "content": "# Environment"}
    assert chat["messages"][0] == {"role": "system", "content": "base"}  # the attribution block is client metadata
    assert [t["function"]["name"] for t in chat["tools"]] == ["Read"] and "tool_choice" not in chat
    assert "user" not in chat and "thinking" not in chat
    assert dropped.header() == (
        "tools[1]=deferred_tool, tools[2]=hosted_tool, tool_choice=tool_choice, system[0]=client_metadata, "
        "messages[1].content[1]=unknown_block, messages[2].content[0]=unknown_block, "
        "messages[3].content[0].content[1]=unknown_block, messages[3].content[1]=unknown_block, "
        "metadata.user_id=client_metadata")


@pytest.mark.parametrize("choice,expected", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                             ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}})])
def test_tool_choice_kinds(choice, expected):
    chat = to_chat({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"name": "w", "input_schema": {"type": "object"}}], "tool_choice": choice})
    assert chat["tool_choice"] == expected


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": 3}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]},
     "messages[0].content[0].source"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "w", "type": "web_search_20250305"}]}, None),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
])
def test_bad_input_names_the_field(body, param):
    if param is None:  # a server tool: refused only when the tenant's hosted_tools says so
        to_chat(body)
        param = "tools[0].type"
        with pytest.raises(InvalidRequest) as e:
            to_chat(body, hosted_tools="refuse")
    else:
        with pytest.raises(InvalidRequest) as e:
            to_chat(body)
    assert e.value.param == param


def test_count_only_needs_no_max_tokens():
    assert to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, count_only=True)["messages"]


def test_chat_answer_to_message_with_tool_use_and_cache_read_usage():
    chat = {"choices": [{"message": {"content": "ok", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "w", "arguments": "{\"q\": \"x\"}"}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}}}
    m = from_chat(chat, "glm", None)
    assert m["content"] == [{"type": "text", "text": "ok"},
                            {"type": "tool_use", "id": "call_0", "name": "w", "input": {"q": "x"}}]
    assert m["stop_reason"] == "tool_use" and m["model"] == "glm"
    assert m["usage"] == {"input_tokens": 36, "output_tokens": 5, "cache_read_input_tokens": 64,
                          "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("finish,matched,stops,expected", [
    ("stop", None, None, ("end_turn", None)), ("length", None, None, ("max_tokens", None)),
    ("tool_calls", None, None, ("tool_use", None)), ("stop", "END", ["END"], ("stop_sequence", "END")),
    ("stop", 151329, ["END"], ("end_turn", None))])
def test_stop_reasons(finish, matched, stops, expected):
    assert stop_reason(finish, matched, stops) == expected


def _chunk(delta=None, finish=None):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def test_stream_event_sequence_text_then_tool_use():
    s = MessagesStream("glm", 12, None)
    raw = s.start() + s.chunk(_chunk({"role": "assistant", "content": ""})) + s.chunk(_chunk({"content": "Hi"})) \
        + s.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_0", "function": {"name": "w", "arguments": "{\"q\""}}]})) \
        + s.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})) \
        + s.chunk(_chunk(finish="tool_calls")) \
        + s.chunk({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": 8}}}) + s.done()
    evs = events(raw)
    assert [e["type"] for e in evs] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert evs[2]["content_block"] == {"type": "text", "text": ""} and evs[3]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert evs[5]["index"] == 1 and evs[5]["content_block"]["type"] == "tool_use" and evs[5]["content_block"]["id"] == "call_0"
    assert evs[6]["delta"] == {"type": "input_json_delta", "partial_json": "{\"q\""}
    assert evs[9]["delta"]["stop_reason"] == "tool_use"
    assert evs[9]["usage"]["cache_read_input_tokens"] == 8 and evs[9]["usage"]["input_tokens"] == 4


def test_stream_failure_is_an_error_event():
    s = MessagesStream("glm", 1, None)
    evs = events(s.start() + s.chunk(_chunk({"content": "a"})) +
                 s.error({"message": "reset", "type": "server_error", "code": "upstream_error"}))
    assert evs[-1] == {"type": "error", "error": {"type": "api_error", "message": "reset"}}
    over = events(s.error({"message": "busy", "type": "service_unavailable_error", "code": "server_is_overloaded"}))
    assert over[0]["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("status,kind,out", [(400, "invalid_request_error", 400), (401, "authentication_error", 401),
                                             (403, "permission_error", 403), (404, "not_found_error", 404),
                                             (413, "request_too_large", 413), (429, "rate_limit_error", 429),
                                             (502, "api_error", 502), (503, "overloaded_error", 529)])
def test_error_shapes_and_statuses(status, kind, out):
    assert error_status(status) == out
    assert error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_engine_reasoning_becomes_a_thinking_block():
    chat = {"choices": [{"message": {"content": "ok", "reasoning_content": "hmm"}, "finish_reason": "stop"}]}
    assert [b["type"] for b in from_chat(chat, "glm", None)["content"]] == ["thinking", "text"]
    s = MessagesStream("glm", 1, None)
    evs = events(s.start() + s.chunk(_chunk({"reasoning_content": "hm"})) + s.chunk(_chunk({"content": "ok"}))
                 + s.chunk(_chunk(finish="stop")) + s.done())
    assert [e["type"] for e in evs[2:8]] == ["content_block_start", "content_block_delta", "content_block_stop",
                                             "content_block_start", "content_block_delta", "content_block_stop"]
    assert evs[2]["content_block"]["type"] == "thinking" and evs[3]["delta"] == {"type": "thinking_delta", "thinking": "hm"}
    assert evs[5]["index"] == 1 and evs[-2]["delta"]["stop_reason"] == "end_turn"
