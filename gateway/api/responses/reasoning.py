"""`reasoning.effort` of a Responses request as the chat fields the route's pools understand (pure).

The bridge builds one chat body before routing picks a pool, so the fields must suit every pool the model may be
served by (its route's pools, or the one pinned with `x-gateway-pool`):

- hosted OpenAI-compatible and litellm pools: chat `reasoning_effort`, the value as the client sent it (the
  provider validates it; litellm maps it per provider).
- SGLang pools (the `narrow_reasoning_effort` capability in upstreams.py): chat `reasoning_effort` too, but only
  the tiers every 0.5.x release accepts. 0.5.9 and 0.5.13 type it `Literal["low", "medium", "high"]` (anything else
  is a 400); 0.5.23 adds none / minimal / xhigh / ultra / max. So `minimal` is sent as `low`, `xhigh` / `ultra` /
  `max` as `high`, and `none` as `chat_template_kwargs.enable_thinking: false` — the switch GLM's (and Qwen3's)
  template and reasoning parser read in every 0.5.x (0.5.23 maps `none` to the same).
- a route mixing both: only low / medium / high (valid everywhere) are sent; other tiers are dropped, deliberately,
  rather than refused by one of the pools after a failover.

The Response object echoes the client's `reasoning` whatever was sent.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.upstreams import CAPABILITIES

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
PORTABLE = ("low", "medium", "high")  # every pool kind and every SGLang 0.5.x release
NARROWED = {"minimal": "low", "xhigh": "high", "ultra": "high", "max": "high"}  # on narrow_reasoning_effort pools


def effort_of(reasoning: Any) -> str | None:
    """The validated `reasoning.effort` (None when absent); 400 naming `reasoning.effort` otherwise."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise InvalidRequest("'reasoning' must be an object.", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(f"reasoning.effort must be one of {', '.join(EFFORTS)}.", param="reasoning.effort")
    return effort if isinstance(effort, str) else None


def chat_fields(effort: str | None, kinds: frozenset[str], chat: dict[str, Any]) -> dict[str, Any]:
    """The chat body fields for `effort` on pools of these kinds, by their `narrow_reasoning_effort` capability
    (`chat`: the body so far, for a client's own `chat_template_kwargs`)."""
    if effort is None:
        return {}
    narrow = [CAPABILITIES[k].narrow_reasoning_effort for k in kinds]
    if not any(narrow):  # no pool narrows it (or the model is unknown, which the chat path refuses anyway)
        return {"reasoning_effort": effort}
    if effort in PORTABLE:
        return {"reasoning_effort": effort}
    if not all(narrow):  # mixed route: a tier one of its pools would refuse
        return {}
    if effort == "none":
        ctk = chat.get("chat_template_kwargs")
        return {"chat_template_kwargs": {**(ctk if isinstance(ctk, dict) else {}), "enable_thinking": False}}
    return {"reasoning_effort": NARROWED[effort]}
