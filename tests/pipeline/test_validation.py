"""Edge validation (issue 10 build 1, issue 17 build 2): impossible values of known fields are a 400 naming the
field, before anything reaches an engine; unknown fields and every value the API allows pass untouched."""

import pytest

from gateway.config import parse_config
from gateway.errors import InvalidRequest
from gateway.pipeline.validation import (
    MAX_JSON_DEPTH,
    RequestLimits,
    check_limits,
    limits_for,
    parse_json,
    validate,
)
from tests.gateway_fixtures import config, sglang_pool

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def _bad(body, endpoint="chat/completions", limits=None):
    with pytest.raises(InvalidRequest) as e:
        validate(body, endpoint, limits)
    return e.value


# (endpoint, extra fields, param named in the 400)
REFUSED = [
    ("completions", {"n": 1_000_000}, "n"),
    ("chat/completions", {"n": 0}, "n"),
    ("chat/completions", {"n": 129}, "n"),
    ("chat/completions", {"n": 1.5}, "n"),
    ("completions", {"max_tokens": 1e308}, "max_tokens"),
    ("completions", {"max_tokens": -5}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 2**31}, "max_tokens"),
    ("chat/completions", {"max_completion_tokens": 1e308}, "max_completion_tokens"),
    ("chat/completions", {"max_tokens": "16"}, "max_tokens"),
    ("chat/completions", {"max_completion_tokens": 5, "max_tokens": 1e308}, "max_tokens"),
    ("completions", {"logprobs": 1e308}, "logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"best_of": 21}, "best_of"),
    ("chat/completions", {"logprobs": 5}, "logprobs"),
    ("chat/completions", {"top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"temperature": 2.5}, "temperature"),
    ("chat/completions", {"temperature": -0.1}, "temperature"),
    ("chat/completions", {"temperature": 1e308}, "temperature"),
    ("chat/completions", {"temperature": "hot"}, "temperature"),
    ("chat/completions", {"top_p": 1.01}, "top_p"),
    ("chat/completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ("chat/completions", {"seed": 2**63}, "seed"),
    ("chat/completions", {"seed": 1e308}, "seed"),
    ("chat/completions", {"logit_bias": {"50256": 101}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {str(2**31): 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": [1]}, "logit_bias"),
    ("chat/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat/completions", {"stop": [1]}, "stop"),
    ("completions", {"stop": 5}, "stop"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0].type"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
    ("chat/completions", {"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0].type"),
    ("chat/completions", {"messages": "x"}, "messages"),
    ("chat/completions", {"tools": [1], "tool_choice": "required"}, "tools[0]"),
    ("chat/completions", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ("chat/completions", {"tool_choice": "always"}, "tool_choice"),
    ("chat/completions", {"tool_choice": ["auto"]}, "tool_choice"),
    ("chat/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("completions", {"prompt": [1099511627776]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [1.5]}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": [[], []]}, "prompt"),
    ("completions", {"prompt": [""]}, "prompt"),
    ("completions", {"prompt": [[1, "a"]]}, "prompt"),
    ("completions", {"prompt": ["a", 1]}, "prompt"),
    ("completions", {"prompt": [True]}, "prompt"),
]


@pytest.mark.parametrize("endpoint,extra,param", REFUSED, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(REFUSED)])
def test_impossible_values_are_a_400_naming_the_field(endpoint, extra, param):
    """Each impossible value is refused at the edge with `param` naming the field, so no engine sees it."""
    base = CHAT if endpoint == "chat/completions" else COMP
    err = _bad({**base, **extra}, endpoint)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param


ACCEPTED = [
    ("chat/completions", {"n": 128, "max_completion_tokens": 1, "temperature": 0, "top_p": 1, "presence_penalty": -2,
                          "frequency_penalty": 2.0, "seed": -(2**63), "logprobs": True, "top_logprobs": 20,
                          "logit_bias": {"50256": -100, "7": 99.5}, "stop": ["a", "b", "c", "d"]}),
    ("chat/completions", {"stop": "\n", "seed": 2**63 - 1, "temperature": 2, "logprobs": None, "stop_token_ids": [1]}),
    ("chat/completions", {"messages": [{"role": r, "content": "x"} for r in
                                       ("system", "developer", "user", "assistant", "tool", "function")]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "input_audio", "input_audio": {}}, {"type": "file", "file": {}}, {"type": "video_url"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]}),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                                    {"type": "custom", "custom": {"name": "g"}}],
                          "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("chat/completions", {"tool_choice": "auto", "whatever_new_field": {"deep": [1, 2]}, "top_k": 5}),
    ("completions", {"logprobs": 0, "best_of": 2, "max_tokens": 2**31 - 1, "prompt": [0, 1, 2**31 - 1]}),
    ("completions", {"prompt": [[1, 2], [3]], "logprobs": 5}),
    ("completions", {"prompt": ["a", "b"], "stop": []}),
]


@pytest.mark.parametrize("endpoint,extra", ACCEPTED)
def test_allowed_values_and_unknown_fields_pass_untouched(endpoint, extra):
    """Everything the API documents as valid (and anything the gateway does not know) is accepted unchanged."""
    base = CHAT if endpoint == "chat/completions" else COMP
    body = {**base, **extra}
    snapshot = repr(body)
    p = validate(body, endpoint)
    assert p.body is body and repr(body) == snapshot


def test_pool_cap_on_n_and_context_bound_max_tokens():
    """A route's limits narrow the API bounds: n above the pool's cap and max_tokens above the context are 400s."""
    lim = RequestLimits(max_n=8, context_tokens=4096)
    assert _bad({**COMP, "n": 9}, "completions", lim).param == "n"
    assert "cap" in _bad({**COMP, "n": 9}, "completions", lim).message
    assert _bad({**COMP, "max_tokens": 4097}, "completions", lim).param == "max_tokens"
    assert _bad({**CHAT, "max_completion_tokens": 4097}, limits=lim).param == "max_completion_tokens"
    p = validate({**COMP, "n": 8, "max_tokens": 4096}, "completions", lim)
    assert p.max_output_tokens == 4096
    with pytest.raises(InvalidRequest):
        check_limits(validate({**COMP, "n": 9}, "completions"), "completions", lim)


def test_limits_for_takes_the_narrowest_pool():
    """sglang pools default to n <= 8, hosted pools to the API's 128; an explicit max_n/context_tokens wins; a
    route across pools gets the narrowest (any of them may serve the request)."""
    hosted = {"name": "h", "kind": "openai", "model": "glm", "base_url": "https://x/v1"}
    cfg = parse_config(config([sglang_pool("s", ["http://127.0.0.1:1"]), hosted],
                              models=[{"name": "glm-5.2", "pools": ["s", "h"]}]))
    assert limits_for(cfg, ["h"]) == RequestLimits(max_n=128, context_tokens=None)
    assert limits_for(cfg, ["s", "h"]).max_n == 8
    cfg2 = parse_config(config([{**sglang_pool("s", ["http://127.0.0.1:1"]), "max_n": 16, "context_tokens": 131072},
                                {**hosted, "context_tokens": 200000}],
                               models=[{"name": "glm-5.2", "pools": ["s", "h"]}]))
    assert limits_for(cfg2, ["s", "h"]) == RequestLimits(max_n=16, context_tokens=131072, max_sequences=64)


def test_limits_for_uses_the_servers_reported_context_unless_configured():
    """Without `context_tokens` in the config, the smallest context_length the pool's servers reported in
    /server_info bounds max_tokens; servers that have not reported (None) do not count; the config wins."""
    from gateway.upstreams import UpstreamRegistry

    cfg = parse_config(config([sglang_pool("s", ["http://127.0.0.1:1", "http://127.0.0.1:2"])]))
    reg = UpstreamRegistry(cfg)
    assert limits_for(cfg, ["s"], reg).context_tokens is None
    reg.by_pool["s"][0].state.context_tokens = 202752
    assert limits_for(cfg, ["s"], reg).context_tokens == 202752
    reg.by_pool["s"][1].state.context_tokens = 65536
    assert limits_for(cfg, ["s"], reg).context_tokens == 65536
    cfg2 = parse_config(config([{**sglang_pool("s", ["http://127.0.0.1:1"]), "context_tokens": 8192}]))
    reg2 = UpstreamRegistry(cfg2)
    reg2.by_pool["s"][0].state.context_tokens = 65536
    assert limits_for(cfg2, ["s"], reg2).context_tokens == 8192


def _nested(depth: int) -> bytes:
    return b'{"model":"m","x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_json_depth_is_bounded_at_parse_time():
    """A body nested past the limit is a 400 naming the limit (so re-serialising upstream cannot fail); exactly
    at the limit it parses. Depth past orjson's own 1024 limit gets the same answer."""
    assert parse_json(_nested(MAX_JSON_DEPTH))["model"] == "m"
    for depth in (MAX_JSON_DEPTH + 1, 300, 2000):
        with pytest.raises(InvalidRequest) as e:
            parse_json(_nested(depth))
        assert str(MAX_JSON_DEPTH) in e.value.message and e.value.code == "json_too_deep"
    with pytest.raises(InvalidRequest):
        parse_json(_nested(20), max_depth=10)


@pytest.mark.parametrize("items", [0, 10, 5000])
def test_json_depth_bound_holds_whatever_the_body_holds_besides(items):
    """The bound is the same for a body of few items (walked whole) and for one of many (screened by its bytes
    first): a list of `items` numbers and a long string beside the nesting change nothing."""
    def body(depth: int) -> bytes:
        nest = b"[" * (depth - 1) + b"]" * (depth - 1)
        return b'{"model":"m","prompt":"' + b"<1a> " * 4000 + b'","ids":[' + \
            b",".join(b"7" for _ in range(items)) + b'],"x":' + nest + b"}"
    assert parse_json(body(MAX_JSON_DEPTH))["model"] == "m"
    for depth in (MAX_JSON_DEPTH + 1, 300):
        with pytest.raises(InvalidRequest) as e:
            parse_json(body(depth))
        assert e.value.code == "json_too_deep"


@pytest.mark.parametrize("raw", [b"", b"[1]", b"{", b'{"max_tokens": NaN}', b'{"max_tokens": Infinity}',
                                 b'{"max_tokens": 1e309}'])
def test_unparseable_bodies_are_400(raw):
    with pytest.raises(InvalidRequest):
        parse_json(raw)


def test_a_prompt_list_counts_as_prompts_times_n_against_the_pool_cap():
    """A completions prompt list is a batch: 2,000 prompts x n 8 is 16,000 sequences, refused at the door (param
    'prompt') like an oversized n; within the cap it passes; a single token-id prompt is one sequence."""
    lim = RequestLimits(max_n=8, max_sequences=64)
    body = {"model": "m", "prompt": ["a"] * 2000, "n": 8}
    with pytest.raises(InvalidRequest) as e:
        validate(body, "completions", lim)
    assert e.value.param == "prompt" and "16000" in e.value.message
    with pytest.raises(InvalidRequest):
        validate({"model": "m", "prompt": [[1, 2]] * 65}, "completions", lim)
    validate({"model": "m", "prompt": ["a"] * 8, "n": 8}, "completions", lim)
    validate({"model": "m", "prompt": list(range(1, 500))}, "completions", lim)


def test_token_ids_past_the_pools_vocabulary_are_refused():
    """A completions prompt of token ids with an id at or past the pool's `vocab_size` is a 400 naming `prompt`
    (real SGLang does not check, and one such id killed its scheduler); ids below it, strings, and pools without a
    configured vocabulary pass; a route across pools takes the smallest vocabulary."""
    lim = RequestLimits(vocab_size=2048)
    for prompt, where in (([1, 2, 2048], "prompt"), ([[5, 6], [7, 10_000_000]], "prompt[1]")):
        with pytest.raises(InvalidRequest) as e:
            check_limits(validate({"model": "m", "prompt": prompt}, "completions"), "completions", lim)
        err = e.value
        assert err.param == "prompt" and err.code == "token_id_out_of_vocabulary" and err.message.startswith(where)
        assert "2047" in err.message
    for ok in ([0, 2047], [[1], [2047, 3]], "text", ["a", "b"]):
        check_limits(validate({"model": "m", "prompt": ok}, "completions"), "completions", lim)
    check_limits(validate({"model": "m", "prompt": [10_000_000]}, "completions"), "completions", RequestLimits())
    cfg = parse_config(config([{**sglang_pool("s", ["http://127.0.0.1:1"]), "vocab_size": 2048},
                               {**sglang_pool("t", ["http://127.0.0.1:2"]), "vocab_size": 151_936},
                               sglang_pool("u", ["http://127.0.0.1:3"])],
                              models=[{"name": "glm-5.2", "pools": ["s", "t", "u"]}]))
    assert limits_for(cfg, ["s", "t", "u"]).vocab_size == 2048
    assert limits_for(cfg, ["t", "u"]).vocab_size == 151_936
    assert limits_for(cfg, ["u"]).vocab_size is None
