"""The one place policy names map to implementations (unknown names are rejected by the config schema), and the
one place the routing engine is built from config — the gateway and `gateway replay` both call `build_engine`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.config import Routing
from gateway.prediction.ttft import TtftCorrector
from gateway.routing.engine import RoutingEngine
from gateway.routing.policies import baselines, prefix_sla_cost


def _prefix_sla_cost(cfg: Routing) -> tuple[Any, Any, bool]:
    params = prefix_sla_cost.Params(sla_headroom=cfg.sla_headroom, stickiness_penalty_s=cfg.stickiness_penalty_ms / 1000,
                                    bounded_load_factor=cfg.bounded_load_factor, min_hit_tokens=cfg.chunk_tokens,
                                    recompute_weight=cfg.recompute_weight)
    return prefix_sla_cost.decide, params, True


POLICIES: dict[str, Callable[[Routing], tuple[Any, Any, bool]]] = {
    "prefix_sla_cost": _prefix_sla_cost,
    "least_loaded": lambda cfg: (baselines.least_loaded, None, False),
    "round_robin": lambda cfg: (baselines.RoundRobin(), None, False),
}


def build_policy(cfg: Routing) -> tuple[Any, Any, bool]:
    """(policy, params, uses_prefix)."""
    return POLICIES[cfg.policy](cfg)


def build_engine(cfg: Routing, corrector: TtftCorrector | None = None) -> RoutingEngine:
    policy, params, uses_prefix = build_policy(cfg)
    return RoutingEngine(policy, params, uses_prefix=uses_prefix, chunk_tokens=cfg.chunk_tokens,
                         corrector=corrector or TtftCorrector(z=cfg.ttft_quantile_z),
                         speculative_ttl_s=cfg.speculative_ttl_s, residency_ttl_s=cfg.residency_ttl_s,
                         queue_drain=cfg.queue_drain, shortest_prefill_first=cfg.shortest_prefill_first)
