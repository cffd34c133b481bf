"""Which replica served a stored turn, recorded with it, and handed to routing as a hint when the chain continues
(`previous_response_id`): the next turn's prompt starts with this turn's, which that replica holds in its KV cache
whether or not the prefix index still says so (expired, another gateway instance's index, a restart of ours)."""

from __future__ import annotations

from typing import Any


def served_by(replica: str | None, response: dict[str, Any]) -> dict[str, Any] | None:
    """The record's `served_by`: the target name and the prompt tokens it prefilled for this turn."""
    if not replica:
        return None
    usage = response.get("usage")
    tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
    return {"replica": replica, "input_tokens": tokens if isinstance(tokens, int) and tokens > 0 else 0}


def affinity_of(record: dict[str, Any] | None) -> tuple[str, int] | None:
    """(target name, prompt tokens) for `gateway.routing.request.AFFINITY`, from a stored turn (None: no hint)."""
    s = (record or {}).get("served_by")
    if not isinstance(s, dict) or not isinstance(s.get("replica"), str):
        return None
    tokens = s.get("input_tokens")
    return s["replica"], tokens if isinstance(tokens, int) else 0
