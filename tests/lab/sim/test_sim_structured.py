"""The simulator's schema-driven JSON generator: every value validates against its schema, the same seed gives the
same value, and schemas that would make unbounded work are refused instead of run."""

import random
from typing import Literal

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from gateway_lab.sim.choice_plan import plan_chat
from gateway_lab.sim.structured import SchemaError, check_schema, generate
from gateway_lab.sim.validation import ChatCompletionRequest


class Address(BaseModel):
    city: str
    zip_code: str = Field(min_length=5, max_length=5)


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)
    score: float = Field(gt=0, lt=1)
    tags: list[str] = Field(min_length=1, max_length=4)
    kind: Literal["admin", "user"]
    home: Address
    previous: list[Address] = []
    nickname: str | None = None
    active: bool


class Tree(BaseModel):
    label: str
    children: list["Tree"] = []


SCHEMAS = [
    Person.model_json_schema(),  # $defs + $ref, anyOf with null, Literal enum, bounds, nested arrays
    Tree.model_json_schema(),  # recursive through $ref
    {"type": "object", "properties": {"a": {"const": 3}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 100},
     "minItems": 2, "maxItems": 5, "uniqueItems": True},
    {"oneOf": [{"type": "string", "format": "date-time"}, {"type": "integer"}]},
    {"type": ["integer", "null"], "exclusiveMinimum": 0, "exclusiveMaximum": 3},
    {"allOf": [{"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
               {"properties": {"y": {"type": "null"}}, "required": ["y"]}]},
    {"type": "object", "required": ["free"], "minProperties": 2, "additionalProperties": {"type": "number"}},
    True,
    {},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_generated_values_validate_against_their_schema(schema):
    """Over many seeds, every value is valid: constrained decoding never returns text the schema rejects."""
    for seed in range(60):
        value = generate(schema, random.Random(seed))
        jsonschema.validate(value, schema if schema is not True else {})


def test_pydantic_model_round_trips():
    """What `chat.completions.parse(response_format=Model)` needs: the JSON loads back into the model."""
    for seed in range(30):
        Person.model_validate(generate(Person.model_json_schema(), random.Random(seed)))


def test_same_seed_same_value_and_seeds_differ():
    schema = Person.model_json_schema()
    assert generate(schema, random.Random(7)) == generate(schema, random.Random(7))
    assert len({repr(generate(schema, random.Random(s))) for s in range(10)}) > 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "frobnicate"},
        {"type": "object", "properties": []},
        {"type": "array", "minItems": 5, "maxItems": 2},
        {"type": "integer", "minimum": 10, "maximum": 1},
        {"$ref": "#/$defs/missing"},
        {"$ref": "https://example.com/remote.json"},
        {"type": "array", "minItems": 10**9},  # work bound: would be a billion values
        {"type": "string", "minLength": 10**9},
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}},
                                              "required": ["n"]}}},  # a required self-reference never ends
        3,
        False,
    ],
)
def test_malformed_or_unbounded_schemas_are_refused(schema):
    with pytest.raises(SchemaError):
        check_schema(schema)


def _chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], **kw})


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]


def test_tool_choice_rules():
    """auto calls a tool unless the conversation ends with a tool result; none never; named calls that tool."""
    assert plan_chat(_chat(tools=TOOLS), random.Random(1)).calls
    assert plan_chat(_chat(tools=TOOLS, tool_choice="none"), random.Random(1)) is None
    after = _chat(tools=TOOLS, messages=[{"role": "user", "content": "go"},
                                         {"role": "assistant", "content": None, "tool_calls": []},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "17"}])
    assert plan_chat(after, random.Random(1)) is None
    assert plan_chat(after.model_copy(update={"tool_choice": "required"}), random.Random(1)).calls
    named = plan_chat(_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
                      random.Random(1))
    assert [c[1] for c in named.calls] == ["add"]


def test_tool_arguments_conform_ids_unique_and_tokens_cover_the_text():
    import json

    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ids = set()
    for seed in range(40):
        plan = plan_chat(_chat(tools=TOOLS), random.Random(seed))
        for call_id, name, args in plan.calls:
            jsonschema.validate(json.loads(args), by_name[name])
            assert call_id.startswith("call_") and call_id not in ids
            ids.add(call_id)
        # the output tokens are the arguments cut in 4-character pieces, call after call
        assert "".join(t for _, t in plan.pieces) == "".join(a for _, _, a in plan.calls)
        assert plan.tokens == sum(-(-len(a) // 4) for _, _, a in plan.calls)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["object", "array", "string", "integer", "number", "null", "#", "#/$defs/a", "date-time"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "properties", "required", "items", "prefixItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
         "$defs", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "multipleOf", "minLength",
         "maxLength", "minProperties", "additionalProperties", "uniqueItems", "format", "a"]), inner, max_size=4),
    max_leaves=15,
)


@settings(max_examples=300, deadline=None)
@given(schema=_json, seed=st.integers(0, 3))
def test_any_schema_gives_a_value_or_schema_error(schema, seed):
    """Whatever a client sends as a schema, the generator answers a value or SchemaError (a 400), never crashes;
    and when it answers, the value is writable JSON."""
    import orjson

    try:
        value = generate(schema, random.Random(seed))
    except SchemaError:
        return
    orjson.dumps(value)
