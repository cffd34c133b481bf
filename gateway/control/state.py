"""On-call changes that every gateway instance obeys: drained replicas, pool weight/price overrides, temporary
tenant overrides, and live tenant policy changes (limits, budgets, SLA, priority, aliases, pools) layered over the
policy files. A plain value (pure); `store.py` persists it, `plane.py` applies it."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from gateway.config import PerTokenPricing
from gateway.typed import Strict


class PoolOverride(Strict):
    weight: float | None = Field(default=None, ge=0, description="0: no new traffic; >0: routing cost / weight")
    pricing: PerTokenPricing | None = Field(default=None, description="replaces a per-token pool's price")


class TenantOverride(Strict):
    """Temporary: gone at `expires_at` (epoch seconds) without anyone having to remember it."""

    expires_at: float
    ttft_sla_ms: float | None = Field(default=None, gt=0)
    pin_pool: str | None = Field(default=None, min_length=1, description="serve only from this pool")
    objective: Literal["cost", "latency"] | None = None
    on_sla_miss: Literal["spill", "shed"] | None = None
    flow_band: str | None = Field(default=None, min_length=1, description="flow control band (one of flow.bands)")
    flow_weight: float | None = Field(default=None, gt=0, le=10_000, description="flow control weight in its band")

    def active(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


class LivePolicy(Strict):
    """A tenant's live policy change: the fields set over its policy file (same shape and merge rules as a tenant
    file over defaults.yaml: nested sections merge by key, lists replace, null clears a limit). `version` counts
    every write to it, so a change is a compare-and-set on the version it was computed from; a cleared change keeps
    its version (an empty `fields`) so a stale writer can never win after a clear."""

    fields: dict[str, Any] = Field(default_factory=dict)
    version: int = Field(default=0, ge=0)


class ControlState(Strict):
    drained: frozenset[str] = frozenset()
    pools: dict[str, PoolOverride] = Field(default_factory=dict)
    tenants: dict[str, TenantOverride] = Field(default_factory=dict)
    policies: dict[str, LivePolicy] = Field(default_factory=dict)  # tenant -> live policy change

    def live_tenants(self, now: float | None = None) -> dict[str, TenantOverride]:
        return {k: v for k, v in self.tenants.items() if v.active(now)}
