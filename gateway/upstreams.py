"""The upstream targets (one per SGLang replica, one per hosted pool) and their live state."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gateway.config import GatewayConfig, GpuHourPricing, LiteLLMPool, OpenAIPool, PerTokenPricing, PoolTiming, SGLangPool
from gateway.dispatch.circuit_breaker import CircuitBreaker
from gateway.prediction.ttft import LoadView


@dataclass(eq=False)
class Target:
    pool: str
    name: str  # replica name (SGLang) or pool name (hosted)
    kind: str  # sglang | openai | litellm
    base_url: str  # SGLang: server root; openai: base URL including /v1; litellm: api_base or ""
    upstream_model: str
    api_key: str | None
    health_path: str
    pricing: PerTokenPricing | GpuHourPricing | None
    breaker: CircuitBreaker
    timing: PoolTiming = PoolTiming()
    incarnation: str = "0"
    engine_load: LoadView | None = None  # from the engine's own /v1/loads
    healthy: bool = True
    drained: bool = False
    weight: float = 1.0  # the pool's; 0 takes no new traffic, otherwise routing cost is divided by it
    inflight: int = 0
    health_failures: int = 0
    last_error: str = ""
    meta: dict[str, object] = field(default_factory=dict)

    def url(self, endpoint: str) -> str:
        """endpoint: 'chat/completions' | 'completions' | 'models'."""
        if self.kind == "sglang":
            return f"{self.base_url}/v1/{endpoint}"
        return f"{self.base_url}/{endpoint}"

    def health_url(self) -> str:
        return f"{self.base_url}{self.health_path}"

    @property
    def index_key(self) -> str:
        return f"{self.name}@{self.incarnation}"

    def routable(self) -> bool:
        return self.healthy and not self.drained and self.weight > 0 and self.breaker.available()


class UpstreamRegistry:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.targets: list[Target] = []
        self.by_pool: dict[str, list[Target]] = {}
        cb = cfg.circuit_breaker
        for pool in cfg.pools:
            key = os.environ.get(pool.api_key_env) if pool.api_key_env else None
            if isinstance(pool, SGLangPool):
                ts = [
                    Target(pool.name, r.name, "sglang", r.url, pool.model, key, pool.health_path, pool.pricing,
                           CircuitBreaker(cb.failure_threshold, cb.cooldown_s), pool.timing)
                    for r in pool.replicas
                ]
            elif isinstance(pool, OpenAIPool):
                ts = [Target(pool.name, pool.name, "openai", pool.base_url, pool.model, key, pool.health_path,
                             pool.pricing, CircuitBreaker(cb.failure_threshold, cb.cooldown_s), pool.timing)]
            else:
                assert isinstance(pool, LiteLLMPool)
                ts = [Target(pool.name, pool.name, "litellm", pool.api_base or "", pool.model, key, "",
                             pool.pricing, CircuitBreaker(cb.failure_threshold, cb.cooldown_s), pool.timing)]
            for t in ts:
                t.weight = pool.weight
            self.by_pool[pool.name] = ts
            self.targets.extend(ts)

    def head(self, pool: str) -> Target | None:
        """The pool's first target: it carries what is pool-wide (pricing, timing, weight)."""
        ts = self.by_pool.get(pool)
        return ts[0] if ts else None

    def get(self, name: str) -> Target | None:
        return next((t for t in self.targets if t.name == name), None)
