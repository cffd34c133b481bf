"""Upstream usage is untrusted input: validated and clamped before anything counts, prices or shows it.

An engine bug (the simulator once reported `cached_tokens: -64`), a provider's odd types or a corrupted chunk must
never turn a served response into a 500, skip accounting, or poison a Prometheus counter. `clean_usage` is pure and
total: whatever it is given, it returns an OpenAI usage object whose counts are ints in [0, MAX_TOKENS] with
cached <= prompt and total = prompt + completion, plus the list of anomalies it corrected (a bounded set of kinds,
counted in `gateway_upstream_usage_anomalies_total{pool,kind}` and logged by accounting).
"""

from __future__ import annotations

import math
from typing import Any

MAX_TOKENS = 100_000_000  # per field and request; far above any context window, below float trouble
KINDS = ("malformed", "not_integer", "negative", "out_of_range", "cached_exceeds_prompt")


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


def clean_usage(raw: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """(clamped usage or None when there is none, anomalies). Unknown keys are kept as they came."""
    if raw is None:
        return None, []
    if not isinstance(raw, dict):
        return None, ["malformed"]
    anomalies: list[str] = []
    prompt = _count(raw.get("prompt_tokens"), anomalies)
    completion = _count(raw.get("completion_tokens"), anomalies)
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
