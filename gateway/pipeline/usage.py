"""Upstream usage is untrusted input: validated and bounded before anything counts, prices or shows it.

An engine bug (the simulator once reported `cached_tokens: -64`), a provider's odd types or a corrupted chunk must
never turn a served response into a 500, skip accounting, or poison a Prometheus counter; and no upstream may bill a
tenant for more than the request could have used (one reported 10^8 tokens for a `max_tokens: 5` request: $340).
`clean_usage` is pure and total: whatever it is given, it returns an OpenAI usage object whose counts are ints in
[0, MAX_TOKENS] with cached <= prompt and total = prompt + completion, plus the list of anomalies it corrected (a
bounded set of kinds, counted in `gateway_upstream_usage_anomalies_total{pool,kind}` and logged by accounting).

Given the request's `UsageBound` it also clamps each count to what the request allows (`bound_for`):
- completion tokens <= `max_tokens` (or `max_completion_tokens`) x the sequences asked (`n`, times the prompts of a
  completions batch); without `max_tokens`, the serving pool's context length (or `usage_bounds.max_output_tokens`)
  per sequence: the engine can generate no more;
- prompt tokens <= the gateway's own count x `usage_bounds.prompt_factor` + `prompt_slack_tokens` (+
  `media_tokens` per image, audio or video part, which the gateway does not tokenize), and <= the context length per
  prompt: a real tokenizer and chat template may count more than the gateway's 4-characters rule, never that much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 100_000_000  # per field and request; far above any context window, below float trouble
KINDS = ("malformed", "not_integer", "negative", "out_of_range", "cached_exceeds_prompt", "prompt_over_bound",
         "completion_over_bound")
MEDIA_PARTS = frozenset({"image_url", "input_image", "input_audio", "video_url", "audio_url", "file", "input_file"})


@dataclass(frozen=True)
class UsageBound:
    """The most a request can have used: prompt and completion tokens (the same for every attempt)."""

    prompt: int
    completion: int


def bound_for(body: dict[str, Any], own_prompt_tokens: int, max_output: int | None, context: int | None,
              prompt_factor: float, prompt_slack: int, media_tokens: int, default_max_output: int) -> UsageBound:
    """The request's bound (see the module docstring). `own_prompt_tokens`: the gateway's count; `max_output`:
    max_tokens or max_completion_tokens as validated; `context`: the serving pool's context length, if known."""
    n = body.get("n")
    seqs = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    per_seq = max_output if max_output is not None else (context or default_max_output)
    completion = min(per_seq * seqs * prompts, MAX_TOKENS)
    allowed = own_prompt_tokens * prompt_factor + prompt_slack + media_tokens * _media_parts(body.get("messages"))
    if context:
        allowed = min(allowed, context * prompts)
    return UsageBound(min(int(allowed), MAX_TOKENS), completion)


def _media_parts(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            n += sum(1 for p in content if isinstance(p, dict) and p.get("type") in MEDIA_PARTS)
    return n


def _count(v: Any, anomalies: list[str]) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        anomalies.append("not_integer")
        return 0
    if isinstance(v, float):
        if not math.isfinite(v):
            anomalies.append("not_integer")
            return 0 if math.isnan(v) or v < 0 else MAX_TOKENS
        if not v.is_integer():
            anomalies.append("not_integer")
        v = int(v)
    if v < 0:
        anomalies.append("negative")
        return 0
    if v > MAX_TOKENS:
        anomalies.append("out_of_range")
        return MAX_TOKENS
    return int(v)


def clean_usage(raw: Any, bound: UsageBound | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """(clamped usage or None when there is none, anomalies). Unknown keys are kept as they came. With `bound`,
    counts beyond the request's bound are clamped to it (`prompt_over_bound`, `completion_over_bound`)."""
    if raw is None:
        return None, []
    if not isinstance(raw, dict):
        return None, ["malformed"]
    anomalies: list[str] = []
    prompt = _count(raw.get("prompt_tokens"), anomalies)
    completion = _count(raw.get("completion_tokens"), anomalies)
    if bound is not None:
        if prompt > bound.prompt:
            anomalies.append("prompt_over_bound")
            prompt = bound.prompt
        if completion > bound.completion:
            anomalies.append("completion_over_bound")
            completion = bound.completion
    out = dict(raw)
    out["prompt_tokens"], out["completion_tokens"], out["total_tokens"] = prompt, completion, prompt + completion
    details = raw.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        anomalies.append("malformed")
        out.pop("prompt_tokens_details")
    elif isinstance(details, dict) and "cached_tokens" in details and details["cached_tokens"] is not None:
        cached = _count(details["cached_tokens"], anomalies)
        if cached > prompt:
            anomalies.append("cached_exceeds_prompt")
            cached = prompt
        out["prompt_tokens_details"] = {**details, "cached_tokens": cached}
    return out, sorted(set(anomalies)) if anomalies else anomalies


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int | None, int]:
    """(prompt, cached — None when the engine does not report it, completion) from a *cleaned* usage object."""
    if not usage:
        return 0, None, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if type(details) is dict else None
    return int(usage.get("prompt_tokens") or 0), cached if type(cached) is int else None, int(usage.get("completion_tokens") or 0)
