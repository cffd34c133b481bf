"""The Responses bridge's pure parts: request -> chat body, chat answer -> Response object, chat chunks -> the
Responses event sequence, and the memory store's caps."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from gateway.api.dropped import Dropped
from gateway.api.responses.output import from_chat, history_of
from gateway.api.responses.store import MemoryResponseStore
from gateway.api.responses.stream import ResponsesStream
from gateway.api.responses.translate import items_to_messages, parse_request, truncate
from gateway.config import ResponsesConfig
from gateway.errors import InvalidRequest
from gateway.prefix.hashing import prefix_hashes
from gateway.tokenizer import count_tokens, render_chat

LIMIT = 200_000


def events(raw: bytes) -> list[dict]:
    """(event name checked against the data's type) -> the data objects, in order."""
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        name, data = block.split(b"\n")
        ev = orjson.loads(data[len(b"data: "):])
        assert name == b"event: " + ev["type"].encode()
        out.append(ev)
    return out


def test_string_input_and_instructions_become_system_then_user():
    req = parse_request({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5,
                         "temperature": 0.2, "top_p": 0.9, "ignore_eos": True}, [], LIMIT)
    assert req.chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert req.chat["max_tokens"] == 5 and req.chat["temperature"] == 0.2 and req.chat["top_p"] == 0.9
    assert req.chat["ignore_eos"] is True  # unknown fields pass through like the chat path's
    assert req.store is True and "stream_options" not in req.chat


def test_function_tools_choice_and_json_schema_map_to_chat():
    req = parse_request({"model": "m", "input": "x", "stream": True,
                         "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                         "tool_choice": {"type": "function", "name": "f"},
                         "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"},
                                             "strict": True}}}, [], LIMIT)
    assert req.chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert req.chat["response_format"] == {"type": "json_schema",
                                           "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}
    assert req.chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "input"),
    ({"input": "x"}, "model"),
    ({"model": "m", "input": 3}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": None}]}, "tools[0].type"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input"),  # left out: nothing remains
    ({"model": "m", "input": [{"role": "user", "content": [{"type": 1}]}]}, "input[0].content[0].type"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
])
def test_bad_input_names_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, [], LIMIT)
    assert e.value.param == param and e.value.status == 400


def test_function_call_round_trip_items_become_one_assistant_turn_then_tool_results():
    items = [{"type": "message", "role": "user", "content": "weather?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": "rain"}]
    req = parse_request({"model": "m", "input": items}, [], LIMIT)
    msgs = req.chat["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert msgs[1]["content"] == "checking" and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_chained_turn_hashes_as_the_chat_client_would_have_sent_it():
    """Turn 2 via previous_response_id renders the same prompt (so the same prefix hashes, so the same replica) as
    the whole conversation sent in chat form."""
    t1 = parse_request({"model": "m", "input": "first question " * 200}, [], LIMIT)
    chat1 = {"choices": [{"message": {"role": "assistant", "content": "an answer " * 50}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 800, "completion_tokens": 120, "prompt_tokens_details": {"cached_tokens": 0}}}
    r1 = from_chat(chat1, "resp_1", 0, 1, t1)
    stored = {"response": r1, "input_items": t1.input_items}
    t2 = parse_request({"model": "m", "input": "second", "previous_response_id": "resp_1"}, history_of(stored), LIMIT)
    as_chat = {"messages": [{"role": "user", "content": "first question " * 200},
                            {"role": "assistant", "content": "an answer " * 50},
                            {"role": "user", "content": "second"}]}
    assert t2.chat["messages"] == as_chat["messages"]
    h1 = prefix_hashes("chat/completions", t1.chat, "m", chunk_tokens=16)
    h2 = prefix_hashes("chat/completions", t2.chat, "m", chunk_tokens=16)
    assert len(h2) > len(h1) > 0 and h2[:len(h1)] == h1


def test_chat_answer_maps_to_output_items_status_and_cached_usage():
    req = parse_request({"model": "m", "input": "x"}, [], LIMIT)
    chat = {"choices": [{"message": {"content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"q\":1}"}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                  "prompt_tokens_details": {"cached_tokens": 64}}}
    r = from_chat(chat, "resp_x", 10, 11, req)
    assert r["status"] == "completed" and [o["type"] for o in r["output"]] == ["function_call"]
    assert r["output"][0]["call_id"] == "call_0" and r["output"][0]["arguments"] == "{\"q\":1}"
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 64 and r["usage"]["total_tokens"] == 107
    cut = from_chat({"choices": [{"message": {"content": "abc"}, "finish_reason": "length"}]}, "r", 0, 1, req)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "abc"


def test_auto_truncation_drops_oldest_turns_keeps_system_and_last():
    items = [{"role": "user", "content": "old " * 400}, {"role": "assistant", "content": "reply " * 400},
             {"role": "user", "content": "new"}]
    req = parse_request({"model": "m", "input": items, "instructions": "sys", "truncation": "auto"}, [], 100)
    assert [m["content"] for m in req.chat["messages"]] == ["sys", "new"]
    full = parse_request({"model": "m", "input": items, "instructions": "sys"}, [], 100)
    assert len(full.chat["messages"]) == 4


def _truncate_by_rerendering(messages, tools, limit):
    """The definition of `truncation: auto`, one re-rendered prompt per dropped message (quadratic; the oracle)."""
    system = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    while len(rest) > 1 and count_tokens(render_chat(system + rest, tools)) > limit:
        rest.pop(0)
        while len(rest) > 1 and rest[0]["role"] == "tool":
            rest.pop(0)
    return system + rest


def test_auto_truncation_matches_rerendering_at_every_limit():
    """The one-pass truncation (suffix sums of each message's rendered length) keeps exactly the messages the
    re-rendering definition keeps: system first, orphaned tool results dropped with their call, tools counted,
    the last message kept even when it alone is too long."""
    rng = random.Random(7)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for case in range(60):
        msgs = [{"role": "system", "content": "be brief " * rng.randint(0, 20)}] if case % 3 else []
        for i in range(rng.randint(1, 30)):
            kind = rng.choice(["user", "assistant", "call", "tool"])
            if kind == "call":
                msgs.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}" * rng.randint(1, 9)}}]})
            elif kind == "tool":
                msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "out " * rng.randint(0, 60)})
            else:
                msgs.append({"role": kind, "content": [{"type": "text", "text": "w " * rng.randint(0, 200)}]})
        t = tools if case % 2 else None
        for limit in (1, 10, 50, 120, 400, 2_000, 100_000):
            assert truncate(msgs, t, limit) == _truncate_by_rerendering(msgs, t, limit), (case, limit)


def _chunk(delta=None, finish=None, usage=None):
    c = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if usage is None else []}
    if usage is not None:
        c["usage"] = usage
    return c


def test_stream_text_event_sequence_with_sequence_numbers():
    req = parse_request({"model": "m", "input": "x", "stream": True}, [], LIMIT)
    s = ResponsesStream("resp_1", req, clock=lambda: 100.0)
    raw = s.start() + s.chunk(_chunk({"role": "assistant", "content": ""})) + s.chunk(_chunk({"content": "Hel"})) \
        + s.chunk(_chunk({"content": "lo"})) + s.chunk(_chunk(finish="stop")) \
        + s.chunk(_chunk(usage={"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}})) \
        + s.done()
    evs = events(raw)
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    done = evs[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello" and done["status"] == "completed"
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert s.final == done


def test_stream_function_call_arguments_deltas_after_closing_text():
    req = parse_request({"model": "m", "input": "x", "stream": True}, [], LIMIT)
    s = ResponsesStream("resp_1", req)
    raw = s.start() + s.chunk(_chunk({"content": "let me"})) \
        + s.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_0", "function": {"name": "f", "arguments": "{\"a\""}}]})) \
        + s.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]})) \
        + s.chunk(_chunk(finish="tool_calls")) + s.done()
    types = [e["type"] for e in events(raw)]
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    assert types.count("response.function_call_arguments.delta") == 2
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    out = s.final["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[1]["arguments"] == "{\"a\":1}" and out[1]["call_id"] == "call_0" and out[1]["name"] == "f"


def test_stream_upstream_failure_ends_with_error_and_failed():
    req = parse_request({"model": "m", "input": "x", "stream": True}, [], LIMIT)
    s = ResponsesStream("resp_1", req)
    raw = s.start() + s.chunk(_chunk({"content": "par"})) + s.error({"message": "replica reset", "code": "upstream_error"})
    evs = events(raw)
    assert [e["type"] for e in evs[-2:]] == ["error", "response.failed"]
    assert evs[-2]["message"] == "replica reset" and evs[-1]["response"]["status"] == "failed"
    assert evs[-1]["response"]["error"] == {"code": "server_error", "message": "replica reset"}


def test_the_ending_wrapper_knows_when_the_stream_was_ended():
    """The bridge's guard against a silent close: done() or error() ends the stream, a chunk does not."""
    from gateway.api.chat_bridge import Ending

    for end in ("done", "error"):
        e = Ending(ResponsesStream("resp_1", parse_request({"model": "m", "input": "hi", "stream": True}, [], 10_000)))
        e.start()
        e.chunk(_chunk({"content": "par"}))
        assert not e.ended
        e.done() if end == "done" else e.error({"message": "x"})
        assert e.ended


def test_items_to_messages_maps_developer_to_system_and_drops_reasoning():
    msgs = items_to_messages([{"type": "reasoning", "id": "rs", "summary": []},
                              {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]}])
    assert msgs == [{"role": "system", "content": "d"}]


def test_memory_store_ttl_per_tenant_cap_and_isolation():
    now = [0.0]
    store = MemoryResponseStore(ResponsesConfig(ttl_s=10, max_per_tenant=2, max_record_bytes=1024),
                                clock=lambda: now[0])

    async def run():
        assert await store.put("a", "r1", b"x" * 10) and await store.put("a", "r2", b"y")
        assert await store.get("b", "r1") is None  # another tenant's id is absent
        assert not await store.put("a", "big", b"z" * 2048)  # over the record cap: not stored
        await store.put("a", "r3", b"w")  # over the per-tenant cap: the oldest goes
        assert await store.get("a", "r1") is None and await store.get("a", "r3") == b"w"
        now[0] = 11
        assert await store.get("a", "r2") is None  # expired
        assert not await store.delete("a", "r3")

    asyncio.run(run())


def test_engine_reasoning_becomes_a_reasoning_item_before_the_message():
    """SGLang's reasoning parser splits thinking into `reasoning_content`; it is output as a reasoning item (stream
    and not), and dropped again when the turn is continued (the engine's template drops past reasoning)."""
    req = parse_request({"model": "m", "input": "x", "stream": True}, [], LIMIT)
    s = ResponsesStream("resp_1", req)
    raw = s.start() + s.chunk(_chunk({"reasoning_content": "think"})) + s.chunk(_chunk({"reasoning_content": "ing"})) \
        + s.chunk(_chunk({"content": "answer"})) + s.chunk(_chunk(finish="stop")) + s.done()
    types = [e["type"] for e in events(raw)]
    assert types[2:6] == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done"]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    out = s.final["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    non_stream = from_chat({"choices": [{"message": {"content": "answer", "reasoning_content": "thinking"},
                                         "finish_reason": "stop"}]}, "r", 0, 1, req)
    assert [o["type"] for o in non_stream["output"]] == ["reasoning", "message"]
    assert items_to_messages(history_of({"response": non_stream, "input_items": req.input_items})) == \
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "answer"}]


def test_what_codex_sends_is_served_and_what_is_left_out_is_reported():
    """Codex CLI's default request: a namespace of tools, a hosted web_search, items with extra fields, an output
    without call_id (its goals feature), client_metadata with installation and session ids. The turn is served:
    namespaced tools are flattened and their calls come back with their namespace, the hosted tool and the unknown
    item are left out and named, the output answers the latest unanswered call, nothing client-identifying goes
    upstream by default."""
    body = {"model": "gpt-5-codex", "stream": True, "store": False, "prompt_cache_key": "sess-1",
            "client_metadata": {"x-codex-installation-id": "inst"}, "user": "u",
            "tools": [{"type": "function", "name": "get_goal", "parameters": {"type": "object"}},
                      {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                       "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
                      {"type": "custom", "name": "apply_patch", "description": "patch"},
                      {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto",
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}],
                       "internal_chat_message_metadata_passthrough": {"turn_id": "t"}},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"},
                                                                      {"type": "input_file", "file_id": "f"}]},
                      {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                       "arguments": "{}"},
                      {"type": "function_call_output", "output": "spawned"},
                      {"type": "web_search_call", "id": "ws", "status": "completed"},
                      {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
                      {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"}]}
    dropped = Dropped()
    req = parse_request(body, [], LIMIT, dropped=dropped)
    assert [t["function"]["name"] for t in req.chat["tools"]] == \
        ["get_goal", "multi_agent_v1__spawn_agent", "apply_patch"]
    msgs = req.chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "spawned"}
    assert msgs[4]["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                     "arguments": "{\"input\":\"*** Begin\"}"}
    for field in ("client_metadata", "user", "safety_identifier", "prompt_cache_key"):
        assert field not in req.chat
    assert dropped.header() == ("input[1].content[1]=unknown_block, input[4]=unknown_item, tools[3]=hosted_tool, "
                                "user=client_metadata, client_metadata=client_metadata")
    # the model's calls come back as the client named them
    choice = {"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "k1", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}},
        {"id": "k2", "type": "function", "function": {"name": "apply_patch",
                                                      "arguments": "{\"input\": \"diff\"}"}}]}}
    out = from_chat({"choices": [choice]}, "resp_x", 0, 0, req)["output"]
    assert out[0]["type"] == "function_call" and out[0]["namespace"] == "multi_agent_v1" and out[0]["name"] == "spawn_agent"
    assert out[1]["type"] == "custom_tool_call" and out[1]["input"] == "diff" and out[1]["name"] == "apply_patch"
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, [], LIMIT, hosted_tools="refuse")
    assert e.value.param == "tools[3].type"
    assert parse_request(body, [], LIMIT, client_metadata="forward").chat["client_metadata"] == \
        {"x-codex-installation-id": "inst"}


def test_an_output_without_call_id_and_nothing_to_answer_is_left_out():
    dropped = Dropped()
    req = parse_request({"model": "m", "input": [{"role": "user", "content": "x"},
                                                 {"type": "function_call_output", "output": "late"}]}, [], LIMIT,
                        dropped=dropped)
    assert [m["role"] for m in req.chat["messages"]] == ["user"] and dropped.header() == "input[1]=unknown_item"
