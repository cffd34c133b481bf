"""Request bodies for the chaos fuzz, drawn with hypothesis: every field the OpenAI spec defines for chat/completions
and completions (plus a few unknown ones), each either a plausible value or arbitrary JSON, so both the validator's
refusals and the accepted paths are exercised. Drawn once up front (deterministic), sent afterwards."""

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
