"""What agents ask, through the gateway with the real openai SDK, answered by simulated SGLang replicas:
structured output that parses into the caller's pydantic model, and a tool-using loop (tool_choice auto, two tools
with different schemas) whose calls carry schema-valid arguments and distinct ids, streamed and not, and which ends
with a plain text answer once the tool results are sent back."""

import json
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims


class Step(BaseModel):
    action: Literal["search", "answer"]
    detail: str


class Plan(BaseModel):
    goal: str
    steps: list[Step] = Field(min_length=1, max_length=4)
    confidence: float = Field(ge=0, le=1)
    urgent: bool


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "b": {"type": "integer"}, "note": {"type": ["string", "null"]}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client():
    sims, _ = start_sims(2, enable_cache_report=True, time_scale=200.0)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)]))
    yield OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
    gw.stop()
    sims.stop()


def test_parse_returns_a_valid_pydantic_instance(client):
    for seed in range(3):
        r = client.chat.completions.parse(model="glm-5.2", messages=[{"role": "user", "content": f"Plan trip {seed}"}],
                                          response_format=Plan, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Plan)
        # completion_tokens follow the text: 4 characters per token
        assert r.usage.completion_tokens == -(-len(choice.message.content) // 4)


def test_json_object_mode_returns_json(client):
    r = client.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "json please"}],
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _stream_turn(client, messages):
    """One streamed turn, reassembled the way SDK users do: tool-call deltas merged by index."""
    calls: dict[int, dict] = {}
    content, finish, first_deltas = "", None, {}
    for chunk in client.chat.completions.create(model="glm-5.2", messages=messages, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.index not in first_deltas:
                first_deltas[tc.index] = tc  # SGLang: id, name and type come first, arguments later
            slot["id"] = slot["id"] or tc.id
            slot["name"] = slot["name"] or (tc.function.name if tc.function else None)
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.finish_reason or finish
    for tc in first_deltas.values():
        assert tc.id and tc.function.name and tc.type == "function" and not tc.function.arguments
    return content, [calls[i] for i in sorted(calls)], finish


def _turn(client, messages, stream):
    if stream:
        return _stream_turn(client, messages)
    r = client.chat.completions.create(model="glm-5.2", messages=messages, tools=TOOLS)
    ch = r.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls or []]
    return ch.message.content or "", calls, ch.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop_calls_valid_tools_then_answers(client, stream):
    seen_tools, ids = set(), []
    for conversation in range(8):
        messages = [{"role": "user", "content": f"Conversation {conversation}: weather in Paris, and 2+3?"}]
        content, calls, finish = _turn(client, messages, stream)
        assert finish == "tool_calls" and calls
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
            assert c["id"].startswith("call_")
            seen_tools.add(c["name"])
            ids.append(c["id"])
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "17"} for c in calls]
        content, calls, finish = _turn(client, messages, stream)
        assert finish == "stop" and not calls and content  # the loop completes with a text answer
    assert seen_tools == {"get_weather", "add"}  # both schemas exercised
    assert len(ids) == len(set(ids))  # every call has its own id


def test_tool_choice_none_and_named(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="glm-5.2", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model="glm-5.2", messages=msgs, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["add"]
