"""The simulator's request parsing and usage arithmetic, without HTTP: typed like SGLang, bounded, never negative."""

import numpy as np
import pytest

from gateway.tokenizer import VOCAB_SIZE
from gateway_lab.sim.des import EventLoop, VirtualRank
from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import profile
from gateway_lab.sim.protocol import SimHTTPError, usage
from gateway_lab.sim.sim_request import SimRequest
from gateway_lab.sim.validation import MAX_CHOICES, parse_chat, parse_completion

CTX = 1_048_576


def test_zero_token_sequence_reports_zero_cached_not_minus_a_page():
    """The `prompt: [""]` bug at its root: a 0-token request once got cached = (0 - 1) // 64 * 64 = -64, which a
    Prometheus counter refuses and which broke the gateway's accounting. The engine clamps; the server refuses it."""
    cfg = profile("mi355x-glm52-tp4")
    loop = EventLoop()
    vr = VirtualRank(Rank(cfg), loop)
    req = SimRequest("r", [], 0, 1, "length", 0.0, lambda ev: None)
    vr.rank.submit(req)
    vr.kick()
    loop.run()
    assert req.cached == 0 and vr.rank.counters.cached_tokens == 0
    with pytest.raises(SimHTTPError, match="Prompt cannot be empty"):
        parse_completion({"prompt": [""]}, VOCAB_SIZE, CTX)


def test_usage_is_clamped():
    u = usage(prompt=3, completion=-1, cached=-64, cache_report=True)
    assert u["completion_tokens"] == 0 and u["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage(prompt=3, completion=1, cached=10, cache_report=True)["prompt_tokens_details"]["cached_tokens"] == 3
    assert usage(prompt=3, completion=1, cached=1, cache_report=False)["prompt_tokens_details"] is None


@pytest.mark.parametrize("prompt,lengths", [
    ("abcdefgh", [2]),
    (["abcd", "efghijkl", "x"], [1, 2, 1]),
    ([5, 6, 7], [3]),
    ([[5, 6], [7]], [2, 1]),
])
def test_completion_prompts_one_sequence_per_batch_member(prompt, lengths):
    req, seqs = parse_completion({"prompt": prompt, "n": 2}, VOCAB_SIZE, CTX)
    assert [len(s) for s in seqs] == lengths and req.n == 2
    assert all(s.dtype == np.uint32 for s in seqs)


@pytest.mark.parametrize("body,fragment", [
    ({"prompt": [[1], []]}, "Prompt cannot be empty"),
    ({"prompt": [VOCAB_SIZE]}, "out of vocabulary"),
    ({"prompt": [[1], [2**40]]}, "out of vocabulary"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
    ({"prompt": "x", "n": 2.5}, "fractional"),
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "choices"),
    ({"prompt": "abcd" * 300}, "longer than the model's context length"),
    ({"prompt": list(range(300))}, "longer than the model's context length"),
])
def test_completion_refusals(body, fragment):
    with pytest.raises(SimHTTPError) as e:
        parse_completion(body, VOCAB_SIZE, 300)
    assert e.value.status == 400 and fragment in e.value.message


def test_lax_types_like_sglang():
    """pydantic's lax mode, as SGLang's FastAPI models: '2' and 2.0 are an int; 2.5 and 1e308 are not."""
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": "2", "max_tokens": 3.0}, VOCAB_SIZE)
    assert req.n == 2 and req.max_tokens == 3
    for bad in ({"max_tokens": 1e308}, {"n": 2.5}, {"stream": "maybe"}, {"tools": [1]}, {"tool_choice": "always"}):
        with pytest.raises(SimHTTPError) as e:
            parse_chat({"messages": [{"role": "user", "content": "x"}], **bad}, VOCAB_SIZE)
        assert e.value.status == 400 and e.value.type == "Bad Request"


@pytest.mark.parametrize("messages,fragment", [
    ([{"role": "wizard", "content": "x"}], "messages.0.role"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": ["x"]}], "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.0.content.0"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": 5}], "messages.1.content"),
])
def test_messages_typed_like_sglang(messages, fragment):
    with pytest.raises(SimHTTPError) as e:
        parse_chat({"messages": messages}, VOCAB_SIZE)
    assert e.value.status == 400 and fragment in e.value.message


def test_messages_sglang_accepts():
    parse_chat({"messages": [{"role": "system", "content": None}, {"role": "developer", "content": "d"},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "image_url", "image_url": {"url": "x"}}]},
                             {"role": "assistant", "content": None, "tool_calls": []},
                             {"role": "tool", "tool_call_id": "c", "content": "r"}]}, VOCAB_SIZE)
