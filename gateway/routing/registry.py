"""The one place policy names map to implementations (unknown names are rejected by the config schema)."""

from __future__ import annotations

from typing import Any

from gateway.config import Routing
from gateway.routing.policies import baselines, prefix_sla_cost


def build_policy(cfg: Routing) -> tuple[Any, Any, bool]:
    """(policy, params, uses_prefix)."""
    if cfg.policy == "prefix_sla_cost":
        params = prefix_sla_cost.Params(sla_headroom=cfg.sla_headroom, stickiness_penalty_s=cfg.stickiness_penalty_ms / 1000,
                                        bounded_load_factor=cfg.bounded_load_factor, min_hit_tokens=cfg.chunk_tokens)
        return prefix_sla_cost.decide, params, True
    if cfg.policy == "least_loaded":
        return baselines.least_loaded, None, False
    return baselines.RoundRobin(), None, False
