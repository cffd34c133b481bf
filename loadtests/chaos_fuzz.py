"""Request bodies for the chaos fuzz, drawn with hypothesis: every field the OpenAI spec defines for chat/completions
and completions, the Responses API's create, and the Anthropic Messages API's create and count_tokens (plus a few
unknown ones), each either a plausible value or arbitrary JSON (type confusion: a string where an object belongs, an
object where a list does...), so both the validators' refusals and the accepted paths are exercised. Drawn once up
front (deterministic), sent afterwards."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=20), st.sampled_from([1e308, -1e308, 2**63, -(2**63) - 1, 1099511627776]))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
SMALL_INT = st.one_of(st.integers(-3, 40), st.sampled_from([0, 1, 2, 128, 129, 10**6, 1e308]))


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, JSON)


ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "robot", ""])
TEXT = st.text(min_size=0, max_size=60)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "nope"]), "x": JSON}))
MESSAGE = st.fixed_dictionaries({"role": maybe(ROLE), "content": maybe(st.one_of(TEXT, st.lists(PART, max_size=3)))})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
     "parameters": st.just({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})})})
COMMON = {
    "max_tokens": maybe(SMALL_INT), "n": maybe(SMALL_INT), "temperature": maybe(st.floats(-1, 3)),
    "top_p": maybe(st.floats(-0.5, 1.5)), "presence_penalty": maybe(st.floats(-3, 3)),
    "frequency_penalty": maybe(st.floats(-3, 3)), "seed": maybe(st.integers()), "stream": maybe(st.booleans()),
    "stop": maybe(st.one_of(TEXT, st.lists(TEXT, max_size=6))), "logit_bias": maybe(st.dictionaries(
        st.integers(-5, 200000).map(str), st.integers(-150, 150), max_size=4)),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": maybe(TEXT), "unknown_field": JSON,
}
CHAT = st.fixed_dictionaries(
    {"model": maybe(st.just("glm-5.2")), "messages": maybe(st.lists(MESSAGE, min_size=0, max_size=4))},
    optional={**COMMON, "max_completion_tokens": maybe(SMALL_INT), "logprobs": maybe(st.booleans()),
              "top_logprobs": maybe(SMALL_INT), "tools": maybe(st.lists(TOOL, max_size=2)),
              "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
              "response_format": maybe(st.sampled_from([{"type": "json_object"}, {"type": "text"}]))})
PROMPT = st.one_of(TEXT, st.lists(TEXT, max_size=3), st.lists(st.integers(-5, 2**40), max_size=6),
                   st.lists(st.lists(st.integers(0, 1000), max_size=4), max_size=3))
COMPLETION = st.fixed_dictionaries(
    {"model": maybe(st.just("glm-5.2")), "prompt": maybe(PROMPT)},
    optional={**COMMON, "logprobs": maybe(SMALL_INT), "echo": maybe(st.booleans()), "suffix": maybe(TEXT),
              "best_of": maybe(SMALL_INT)})
# -- the Responses API ---------------------------------------------------------------------------------------------
INPUT_PART = st.one_of(st.fixed_dictionaries({"type": st.just("input_text"), "text": maybe(TEXT)}),
                       st.fixed_dictionaries({"type": st.sampled_from(["input_image", "input_file", "bogus"]),
                                              "image_url": maybe(TEXT)}))
INPUT_ITEM = st.one_of(
    st.fixed_dictionaries({"role": maybe(ROLE), "content": maybe(st.one_of(TEXT, st.lists(INPUT_PART, max_size=3)))}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "function_call", "reasoning", "message"]),
                           "call_id": maybe(TEXT), "output": maybe(TEXT), "arguments": maybe(TEXT), "name": maybe(TEXT)}))
RESPONSES = st.fixed_dictionaries(
    {"model": maybe(st.just("glm-5.2")), "input": maybe(st.one_of(TEXT, st.lists(INPUT_ITEM, max_size=4)))},
    optional={"instructions": maybe(TEXT), "max_output_tokens": maybe(SMALL_INT), "temperature": maybe(st.floats(-1, 3)),
              "top_p": maybe(st.floats(-0.5, 1.5)), "stream": maybe(st.booleans()), "store": maybe(st.booleans()),
              "previous_response_id": maybe(st.sampled_from(["resp_0123abc", "", "../x", "resp_" + "a" * 80])),
              "tools": maybe(st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": maybe(TEXT),
                                                             "parameters": maybe(st.just({"type": "object"}))}),
                                      max_size=2)),
              "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
              "reasoning": maybe(st.fixed_dictionaries({"effort": maybe(st.sampled_from(["low", "high", "x"]))})),
              "text": maybe(st.fixed_dictionaries({"format": maybe(st.just({"type": "json_object"}))})),
              "truncation": maybe(st.sampled_from(["auto", "disabled"])), "metadata": JSON, "unknown_field": JSON})

# -- the Anthropic Messages API --------------------------------------------------------------------------------------
IMAGE_SOURCE = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["base64", "url"]), "data": maybe(TEXT),
                                                "url": maybe(TEXT), "media_type": maybe(TEXT)}), JSON)
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(TEXT)}),
    st.fixed_dictionaries({"type": st.just("image"), "source": IMAGE_SOURCE}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": maybe(TEXT), "name": maybe(TEXT), "input": JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(TEXT),
                           "content": maybe(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": maybe(TEXT)}), max_size=2)))}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "document", "bogus"]), "x": JSON}),
    JSON)
A_MESSAGE = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system", ""])),
                                   "content": maybe(st.one_of(TEXT, st.lists(BLOCK, max_size=3)))})
MESSAGES_COMMON = {
    "system": maybe(st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": maybe(TEXT)}),
                                             max_size=2))),
    "tools": maybe(st.lists(st.fixed_dictionaries({"name": maybe(TEXT), "input_schema": maybe(
        st.just({"type": "object"})), "description": maybe(TEXT)}), max_size=2)),
    "tool_choice": maybe(st.fixed_dictionaries({"type": maybe(st.sampled_from(["auto", "any", "tool", "none"])),
                                                "name": maybe(TEXT)})),
    "thinking": maybe(st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": maybe(SMALL_INT)})),
    "metadata": maybe(st.fixed_dictionaries({"user_id": maybe(TEXT)})), "unknown_field": JSON,
}
MESSAGES = st.fixed_dictionaries(
    {"model": maybe(st.just("glm-5.2")), "max_tokens": maybe(SMALL_INT), "messages": maybe(st.lists(A_MESSAGE, max_size=4))},
    optional={**MESSAGES_COMMON, "stream": maybe(st.booleans()), "temperature": maybe(st.floats(-1, 3)),
              "top_p": maybe(st.floats(-0.5, 1.5)), "top_k": maybe(SMALL_INT),
              "stop_sequences": maybe(st.lists(TEXT, max_size=6))})
COUNT_TOKENS = st.fixed_dictionaries(
    {"model": maybe(st.just("glm-5.2")), "messages": maybe(st.lists(A_MESSAGE, max_size=4))}, optional=MESSAGES_COMMON)

ADMIN = st.tuples(st.sampled_from(["PUT /admin/pools/{}", "PUT /admin/tenants/{}/override", "POST /admin/explain",
                                   "DELETE /admin/tenants/{}/override", "GET /admin/usage", "GET /admin/decisions",
                                   "POST /admin/replicas/{}/drain"]),
                  st.sampled_from(["fuzz-unknown", "../x", "%00", "a" * 200]), JSON,
                  st.booleans())  # with the admin token or not


def draw(strategy: st.SearchStrategy[Any], n: int, seed: int = 0) -> list[Any]:
    out: list[Any] = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out[:n]


# -- type confusion: every field of a valid body, in turn, replaced by each kind of JSON value ------------------------
CONFUSING: list[Any] = ["x", "", 0, -1, 1.5, True, None, [], {}, [1, "a"], {"a": {"b": 1}}, 1e308, 2**64]
_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
TOOL_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TEMPLATES: dict[str, dict[str, Any]] = {
    "chat/completions": {
        "model": "glm-5.2", "max_tokens": 3, "temperature": 0.5, "stream": False, "n": 1, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "look"},
                                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _PNG}}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"q\": \"a\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "result"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL_SCHEMA}}],
        "tool_choice": "auto", "response_format": {"type": "text"}, "logit_bias": {"5": 1},
        "stream_options": None},
    "completions": {"model": "glm-5.2", "prompt": ["hello", "world"], "max_tokens": 3, "n": 1, "logprobs": 1,
                    "echo": False, "stop": "\n", "best_of": 1, "suffix": "end"},
    "responses": {
        "model": "glm-5.2", "instructions": "be brief", "max_output_tokens": 8, "store": False, "stream": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                               {"type": "input_image", "image_url": "data:image/png;base64," + _PNG}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"q\": \"a\"}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "result"}],
        "tools": [{"type": "function", "name": "f", "parameters": TOOL_SCHEMA}], "tool_choice": "auto",
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}, "truncation": "auto",
        "metadata": {"k": "v"}},
    "messages": {
        "model": "glm-5.2", "max_tokens": 8, "stream": False, "temperature": 0.5, "top_k": 5, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": [
                         {"type": "text", "text": "look"},
                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _PNG}},
                         {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "a"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "result"}]}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": TOOL_SCHEMA}],
        "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u1"}},
}
TEMPLATES["messages/count_tokens"] = {k: v for k, v in TEMPLATES["messages"].items()
                                      if k not in ("max_tokens", "stream", "temperature", "top_k", "stop_sequences")}


def _paths(x: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*at, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*at, i))
    return out


def _replaced(x: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _replaced(x[head], rest, value)}
    out = list(x)
    out[head] = _replaced(out[head], rest, value)
    return out


def confusions(endpoint: str) -> list[Any]:
    """Every field of the endpoint's template (at any depth), each replaced by each CONFUSING value."""
    template = TEMPLATES[endpoint]
    return [_replaced(template, p, v) for p in _paths(template) for v in CONFUSING]
