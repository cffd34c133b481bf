"""Upstream usage is untrusted: whatever an engine reports, what the gateway counts, prices and shows is a set of
ints in range with cached <= prompt, and every correction is named (so it can be counted and logged)."""

from __future__ import annotations

import math

import pytest

from gateway.pipeline.usage import KINDS, MAX_TOKENS, UsageBound, bound_for, clean_usage, usage_counts


def test_a_sane_usage_passes_unchanged_but_for_total():
    raw = {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 1, "prompt_tokens_details": {"cached_tokens": 64},
           "reasoning_tokens": 3}
    out, anomalies = clean_usage(raw)
    assert anomalies == []
    assert out == {**raw, "total_tokens": 107}
    assert usage_counts(out) == (100, 64, 7)


@pytest.mark.parametrize("raw, counts, kinds", [
    # the simulator's `prompt: [""]` answer that once turned a served 200 into a 500
    ({"prompt_tokens": 0, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": -64}}, (0, 0, 5), ["negative"]),
    ({"prompt_tokens": -3, "completion_tokens": -1}, (0, None, 0), ["negative"]),
    ({"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 11}}, (10, 10, 1),
     ["cached_exceeds_prompt"]),
    ({"prompt_tokens": "12", "completion_tokens": True}, (0, None, 0), ["not_integer"]),
    ({"prompt_tokens": 12.5, "completion_tokens": 3.0}, (12, None, 3), ["not_integer"]),
    ({"prompt_tokens": math.inf, "completion_tokens": math.nan}, (MAX_TOKENS, None, 0), ["not_integer"]),
    ({"prompt_tokens": 10**30, "completion_tokens": 2}, (MAX_TOKENS, None, 2), ["out_of_range"]),
    ({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": "x"}, (5, None, 1), ["malformed"]),
    ({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": None}}, (5, None, 1), []),
])
def test_bad_values_are_clamped_and_named(raw, counts, kinds):
    out, anomalies = clean_usage(raw)
    assert usage_counts(out) == counts
    assert anomalies == kinds and set(anomalies) <= set(KINDS)
    p, c, o = usage_counts(out)
    assert 0 <= (c or 0) <= p <= MAX_TOKENS and 0 <= o <= MAX_TOKENS and out["total_tokens"] == p + o


@pytest.mark.parametrize("raw", [[1, 2], "usage", 3])
def test_a_usage_that_is_not_an_object_counts_as_none(raw):
    assert clean_usage(raw) == (None, ["malformed"])


def test_no_usage_is_not_an_anomaly():
    assert clean_usage(None) == (None, [])


BOUND_ARGS = {"prompt_factor": 4.0, "prompt_slack": 512, "media_tokens": 16_384, "default_max_output": 131_072}


@pytest.mark.parametrize("body, own, max_out, context, bound", [
    # completion: max_tokens x n; prompt: own x 4 + 512
    ({"messages": []}, 100, 5, None, UsageBound(912, 5)),
    ({"messages": [], "n": 3}, 100, 5, None, UsageBound(912, 15)),
    # a completions batch: every prompt gets max_tokens x n, and the context bounds each prompt
    ({"prompt": ["a", "b"], "n": 2}, 10, 7, 200, UsageBound(400, 28)),
    ({"prompt": [[1, 2], [3]]}, 3, 4, None, UsageBound(524, 8)),
    ({"prompt": [1, 2, 3]}, 3, 4, None, UsageBound(524, 4)),  # token ids: one prompt
    # no max_tokens: the context per sequence, or the configured default
    ({"messages": []}, 10, None, 8192, UsageBound(552, 8192)),
    ({"messages": []}, 10, None, None, UsageBound(552, 131_072)),
    # media the gateway does not tokenize get their allowance
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                 {"type": "text", "text": "hi"}]}]}, 10, 1, None, UsageBound(552 + 16_384, 1)),
])
def test_the_request_bound(body, own, max_out, context, bound):
    assert bound_for(body, own, max_out, context, **BOUND_ARGS) == bound


def test_counts_past_the_bound_are_clamped_to_it_and_named():
    raw = {"prompt_tokens": 10**12, "completion_tokens": 10**12, "prompt_tokens_details": {"cached_tokens": 10**12}}
    out, anomalies = clean_usage(raw, UsageBound(900, 5))
    assert usage_counts(out) == (900, 900, 5) and out["total_tokens"] == 905
    assert set(anomalies) == {"out_of_range", "prompt_over_bound", "completion_over_bound", "cached_exceeds_prompt"}
    within = {"prompt_tokens": 900, "completion_tokens": 5}
    assert clean_usage(within, UsageBound(900, 5)) == ({**within, "total_tokens": 905}, [])
