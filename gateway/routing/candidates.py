"""Candidates: the targets that may serve this request (serve the model, healthy, not drained, breaker allows)."""

from __future__ import annotations

from gateway.settings.pools import ModelRoute
from gateway.upstreams import Target, UpstreamRegistry


def candidates(route: ModelRoute, registry: UpstreamRegistry) -> tuple[list[Target], list[Target]]:
    """(routable targets in pool order, all targets of the model) — the second tells 'none healthy' from 'none'."""
    all_targets = [t for pool in route.pools for t in registry.by_pool.get(pool, [])]
    return [t for t in all_targets if t.routable()], all_targets
