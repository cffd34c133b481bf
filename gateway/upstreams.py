"""The upstream targets (one per SGLang data-parallel rank, one per hosted pool) and their live state.

An SGLang server started with `--dp-size N` runs N schedulers, each with its own radix cache: routing by prefix
only works if each rank is a target of its own and every request is pinned to the rank it was routed to. So a
server is split into N targets (`mi355x-0/dp0`, `mi355x-0/dp1`) as soon as its rank count is known (config
`dp_size`, else `/server_info`, re-read on every reconnect); until then, or with `dp_pinning: off`, it is one target.
Routing only sees `by_pool`, whose lists are updated in place.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from gateway.circuit_breaker import CircuitBreaker
from gateway.config import (
    GatewayConfig,
    GpuHourPricing,
    LiteLLMPool,
    OpenAIPool,
    PerTokenPricing,
    PoolTiming,
    SGLangPool,
)
from gateway.prediction.ttft import LoadView

DEFAULT_PRIORITY_VALUES = {"high": 10, "normal": 0, "low": -10}


@dataclass(eq=False)
class Target:
    pool: str
    name: str  # replica name (SGLang; `<server>/dp<rank>` for one rank of a DP server) or pool name (hosted)
    kind: str  # sglang | openai | litellm
    base_url: str  # SGLang: server root; openai: base URL including /v1; litellm: api_base or ""
    upstream_model: str
    api_key: str | None
    health_path: str
    pricing: PerTokenPricing | GpuHourPricing | None
    breaker: CircuitBreaker
    timing: PoolTiming = field(default_factory=PoolTiming)
    incarnation: str = "0"
    engine_load: LoadView | None = None  # from the engine's own /v1/loads
    healthy: bool = True
    drained: bool = False
    weight: float = 1.0  # the pool's; 0 takes no new traffic, otherwise routing cost is divided by it
    inflight: int = 0
    health_failures: int = 0
    last_error: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    # -- SGLang server facts (from the config and the preflight's /server_info) --------------------------------
    server: str = ""  # the configured replica name (the server); equals `name` unless split into ranks
    dp_rank: int | None = None  # the rank this target pins; None: the server dispatches itself
    dp_pinning: str = "off"  # body | header | off
    version: str = ""  # SGLang release from /server_info ("" until known)
    priority_scheduling: bool | None = None  # server's enable_priority_scheduling (None: unknown)
    low_priority_values_first: bool = False  # server's --schedule-low-priority-values-first: the mapping is negated
    send_priority: str = "auto"  # auto | always | never
    priority_values: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITY_VALUES))
    context_tokens: int | None = None  # the server's context length (/server_info context_length), for edge limits
    misconfigured: list[str] = field(default_factory=list)  # preflight checks that failed (names)

    def __post_init__(self) -> None:
        if not self.server:
            self.server = self.name

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

    # -- what the upstream request carries for this target -----------------------------------------------------
    def pin_field(self) -> str | None:
        """The body field that pins this target's rank: `routed_dp_rank` from 0.5.13 (where `data_parallel_rank`
        is its deprecated alias, warned on every request), `data_parallel_rank` before or when unknown."""
        if self.dp_rank is None or self.dp_pinning != "body":
            return None
        return "routed_dp_rank" if release(self.version) >= (0, 5, 13) else "data_parallel_rank"

    def pin_headers(self) -> dict[str, str]:
        if self.dp_rank is None or self.dp_pinning != "header":
            return {}
        return {"X-Data-Parallel-Rank": str(self.dp_rank)}

    def priority_for(self, klass: str) -> int | None:
        """The explicit priority to send for a tenant class, or None to send none (see SGLangPool.send_priority)."""
        if self.kind != "sglang" or self.send_priority == "never":
            return None
        if self.send_priority == "auto" and self.priority_scheduling is not True:
            return None
        value = self.priority_values.get(klass, DEFAULT_PRIORITY_VALUES.get(klass, 0))
        return -value if self.low_priority_values_first else value


def release(version: str) -> tuple[int, ...]:
    """'0.5.13.post1' -> (0, 5, 13); '' -> () (unknown sorts below every release)."""
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


class UpstreamRegistry:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.targets: list[Target] = []
        self.by_pool: dict[str, list[Target]] = {}
        self._cb = cfg.circuit_breaker
        self._fixed_ranks: dict[str, int] = {}  # server -> dp_size from the config (discovery does not override)
        self._pinning: dict[str, str] = {}
        cb = cfg.circuit_breaker
        for pool in cfg.pools:
            key = os.environ.get(pool.api_key_env) if pool.api_key_env else None
            if isinstance(pool, SGLangPool):
                pinning = "off" if pool.dp_pinning == "off" else "header" if pool.dp_pinning == "header" else "body"
                ts = []
                for r in pool.replicas:
                    ts.append(Target(pool.name, r.name, "sglang", r.url, pool.model, key, pool.health_path, pool.pricing,
                                     CircuitBreaker(cb.failure_threshold, cb.cooldown_s), pool.timing,
                                     dp_pinning=pinning, send_priority=pool.send_priority,
                                     priority_values={str(k): v for k, v in pool.priority_values.items()}))
                    self._pinning[r.name] = pinning
                    if r.dp_size is not None:
                        self._fixed_ranks[r.name] = r.dp_size
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
        for server, n in self._fixed_ranks.items():
            self.set_ranks(server, n)

    def head(self, pool: str) -> Target | None:
        """The pool's first target: it carries what is pool-wide (pricing, timing, weight)."""
        ts = self.by_pool.get(pool)
        return ts[0] if ts else None

    def get(self, name: str) -> Target | None:
        """A target by its name, or the first rank of a server by the server's configured name."""
        return next((t for t in self.targets if t.name == name), None) or \
            next((t for t in self.targets if t.server == name), None)

    # -- SGLang servers and their ranks ------------------------------------------------------------------------
    def servers(self) -> dict[str, list[Target]]:
        """SGLang server name -> its targets (one, or one per DP rank)."""
        out: dict[str, list[Target]] = {}
        for t in self.targets:
            if t.kind == "sglang":
                out.setdefault(t.server, []).append(t)
        return out

    def set_ranks(self, server: str, discovered: int, **facts: Any) -> list[Target]:
        """Make `server` `n` targets (n = the configured dp_size, else `discovered`; 1 with pinning off), in place in
        `by_pool` and `targets`, and set `facts` (Target fields such as version) on each. Returns its targets."""
        current = [t for t in self.targets if t.server == server]
        if not current:
            return []
        n = self._fixed_ranks.get(server, discovered)
        if self._pinning.get(server) == "off":
            n = 1
        n = max(1, n)
        want_ranks = [None] if n == 1 else list(range(n))
        if [t.dp_rank for t in current] != want_ranks:
            tpl = current[0]
            cb = self._cb
            new = [dataclasses.replace(
                tpl, name=server if rank is None else f"{server}/dp{rank}", dp_rank=rank, engine_load=None, inflight=0,
                health_failures=0, last_error="", breaker=CircuitBreaker(cb.failure_threshold, cb.cooldown_s),
                meta={}, misconfigured=list(tpl.misconfigured), priority_values=dict(tpl.priority_values))
                for rank in want_ranks]
            _splice(self.targets, current, new)
            _splice(self.by_pool[tpl.pool], current, new)
            current = new
        for t in current:
            for k, v in facts.items():
                setattr(t, k, v)
        return current


def _splice(seq: list[Target], old: list[Target], new: list[Target]) -> None:
    """Replace the `old` targets (contiguous or not) by `new` at the first old one's position, in place."""
    ids = {id(t) for t in old}
    at = next(i for i, t in enumerate(seq) if id(t) in ids)
    rest = [t for t in seq if id(t) not in ids]
    before = sum(1 for t in seq[:at] if id(t) not in ids)
    seq[:] = rest[:before] + new + rest[before:]
