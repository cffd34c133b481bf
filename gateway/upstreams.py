"""The upstream targets (one per SGLang data-parallel rank, one per hosted pool) and their live state.

A `Target` is what does not change while it exists: identity, pool, URLs, credentials, timing, the backend's
capabilities, its DP rank and the pool's priority settings. Everything that changes is in its `TargetState`, one
object per target, where each field has exactly one writer (named on the field). Readers see the state through
read-only properties of the same name (`t.healthy`); a target itself cannot be assigned to.

An SGLang server started with `--dp-size N` runs N schedulers, each with its own radix cache: routing by prefix
only works if each rank is a target of its own and every request is pinned to the rank it was routed to. So a
server is split into N targets (`mi355x-0/dp0`, `mi355x-0/dp1`) as soon as its rank count is known (config
`dp_size`, else `/server_info`, re-read on every reconnect); until then, or with `dp_pinning: off`, it is one target.
Routing only sees `by_pool`, whose lists are updated in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.circuit_breaker import BreakerState, CircuitBreaker
from gateway.config import (
    GatewayConfig,
    GpuHourPricing,
    LiteLLMPool,
    OpenAIPool,
    PerTokenPricing,
    PoolTiming,
    SGLangPool,
    VLLMPool,
)
from gateway.observability.logging import log_event
from gateway.prediction.ttft import LoadView
from gateway.probe_gate import ProbeGate
from gateway.secrets import pool_keys

DEFAULT_PRIORITY_VALUES = {"high": 10, "normal": 0, "low": -10}
Pricing = PerTokenPricing | GpuHourPricing


@dataclass(frozen=True)
class Capabilities:
    """What a backend kind can do. Code asks these, never the kind's name."""

    prefix_cache: bool  # the engine keeps a prefix (radix) cache worth routing to: prefix index, KV events
    cache_salt: bool  # honours `cache_salt`: the tenant's cache namespace is sent with every request
    priority: bool  # honours a per-request `priority` (when the server schedules by it)
    dp_ranks: bool  # data-parallel ranks that a request can be pinned to
    engine_loads: bool  # /server_info, /v1/loads and /ping: server facts, the engine's load floor, preflight
    health_probe: bool  # an HTTP liveness probe (litellm: none; its provider is assumed up)
    self_hosted: bool  # an engine we run: bounded batches (the self-hosted n / sequence defaults), simulated as one
    # chat `reasoning_effort` typed to low / medium / high only (SGLang 0.5.9 and 0.5.13; anything else is a 400), and
    # "no thinking" as `chat_template_kwargs.enable_thinking: false`; without it the value is passed as the client sent it
    narrow_reasoning_effort: bool
    # which engine API the poller, preflight and KV-event discovery speak: sglang (/server_info, /v1/loads,
    # /v1/tokenize, kv_events in /server_info), vllm (/version, /metrics, /tokenize, /kv_event_sources), "" none
    engine_api: str = ""


CAPABILITIES: dict[str, Capabilities] = {
    "sglang": Capabilities(prefix_cache=True, cache_salt=True, priority=True, dp_ranks=True, engine_loads=True,
                           health_probe=True, self_hosted=True, narrow_reasoning_effort=True, engine_api="sglang"),
    "vllm": Capabilities(prefix_cache=True, cache_salt=True, priority=True, dp_ranks=False, engine_loads=True,
                         health_probe=True, self_hosted=True, narrow_reasoning_effort=False, engine_api="vllm"),
    "openai": Capabilities(prefix_cache=False, cache_salt=False, priority=False, dp_ranks=False, engine_loads=False,
                           health_probe=True, self_hosted=False, narrow_reasoning_effort=False),
    "litellm": Capabilities(prefix_cache=False, cache_salt=False, priority=False, dp_ranks=False, engine_loads=False,
                            health_probe=False, self_hosted=False, narrow_reasoning_effort=False),
}


@dataclass(eq=False)
class TargetState:
    """A target's changing state. One writer per field (the component named); everyone else reads."""

    breaker: CircuitBreaker  # its own state machine; dispatch (dispatcher.py, ejection.py) calls its methods
    pricing: Pricing | None  # ControlPlane.apply (on-call price override; else the config's)
    weight: float = 1.0  # ControlPlane.apply (the pool's; 0 takes no new traffic, else routing cost is divided by it)
    drained: bool = False  # ControlPlane.apply
    ejected: bool = False  # LatencyOutliers (dispatch/outliers.py: far slower than its peers, for a while)
    # its own state machine: LatencyOutliers opens and closes it, the dispatcher acquires, feedback releases
    probe: ProbeGate = field(default_factory=ProbeGate)
    healthy: bool = True  # HealthChecker (probes; a refused connection the dispatcher reports via `unreachable`)
    health_failures: int = 0  # HealthChecker
    credentials_rejected: bool = False  # HealthChecker (its probe answered 401/403: up, but not with the pool's key)
    last_error: str = ""  # Dispatcher (the last failed attempt's message, for /admin/state)
    engine_load: LoadView | None = None  # EnginePoller (the engine's own /v1/loads row)
    kv_usage: float | None = None  # EnginePoller (/v1/loads `token_usage`, 0..1; None: not reported)
    # -- SGLang server facts: EnginePoller, through UpstreamRegistry.set_ranks (/server_info and the preflight) --
    incarnation: str = "0"  # the simulator's restart id; a new one drops the old prefix entries
    version: str = ""  # SGLang release ("" until known)
    priority_scheduling: bool | None = None  # server's enable_priority_scheduling (None: unknown)
    low_priority_values_first: bool = False  # server's --schedule-low-priority-values-first: the mapping is negated
    context_tokens: int | None = None  # the server's context length, for edge limits
    misconfigured: list[str] = field(default_factory=list)  # preflight checks that failed (names)


SERVER_FACTS = frozenset({"incarnation", "version", "priority_scheduling", "low_priority_values_first",
                          "context_tokens", "misconfigured"})


@dataclass(frozen=True, eq=False)
class Target:
    pool: str
    name: str  # replica name (SGLang; `<server>/dp<rank>` for one rank of a DP server) or pool name (hosted)
    kind: str  # sglang | vllm | openai | litellm: selects the backend; behaviour follows `caps`
    base_url: str  # SGLang: server root; openai: base URL including /v1; litellm: api_base or ""
    api_base: str  # where `<endpoint>` paths go: SGLang `<root>/v1`; otherwise base_url
    upstream_model: str
    api_key: str | None
    health_path: str
    timing: PoolTiming
    caps: Capabilities
    state: TargetState
    server: str = ""  # the configured replica name (the server); equals `name` unless split into ranks
    dp_rank: int | None = None  # the rank this target pins; None: the server dispatches itself
    dp_pinning: str = "off"  # body | header | off
    send_priority: str = "auto"  # auto | always | never
    priority_values: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITY_VALUES))

    def __post_init__(self) -> None:
        if not self.server:
            object.__setattr__(self, "server", self.name)

    def url(self, endpoint: str) -> str:
        """endpoint: 'chat/completions' | 'completions' | 'models'."""
        return f"{self.api_base}/{endpoint}"

    @property
    def index_key(self) -> str:
        return f"{self.name}@{self.state.incarnation}"

    def routable(self, probe: bool = True) -> bool:
        """`probe` False: leave the probe gate out (the outlier detector: a probing replica whose one request is in
        flight is still in routing, one request at a time)."""
        s = self.state
        return (s.healthy and not s.drained and not s.ejected and s.weight > 0 and s.breaker.available()
                and (not probe or s.probe.available()))

    # -- the live state, read-only here (writers: TargetState) -------------------------------------------------
    @property
    def breaker(self) -> CircuitBreaker:
        return self.state.breaker

    @property
    def pricing(self) -> Pricing | None:
        return self.state.pricing

    @property
    def weight(self) -> float:
        return self.state.weight

    @property
    def drained(self) -> bool:
        return self.state.drained

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    @property
    def last_error(self) -> str:
        return self.state.last_error

    @property
    def engine_load(self) -> LoadView | None:
        return self.state.engine_load

    @property
    def incarnation(self) -> str:
        return self.state.incarnation

    @property
    def version(self) -> str:
        return self.state.version

    @property
    def priority_scheduling(self) -> bool | None:
        return self.state.priority_scheduling

    @property
    def low_priority_values_first(self) -> bool:
        return self.state.low_priority_values_first

    @property
    def context_tokens(self) -> int | None:
        return self.state.context_tokens

    @property
    def misconfigured(self) -> list[str]:
        return self.state.misconfigured

    # -- what the upstream request carries for this target -----------------------------------------------------
    def pin_field(self) -> str | None:
        """The body field that pins this target's rank: `routed_dp_rank` from 0.5.13 (where `data_parallel_rank`
        is its deprecated alias, warned on every request), `data_parallel_rank` before or when unknown."""
        if self.dp_rank is None or self.dp_pinning != "body":
            return None
        return "routed_dp_rank" if release(self.state.version) >= (0, 5, 13) else "data_parallel_rank"

    def pin_headers(self) -> dict[str, str]:
        if self.dp_rank is None or self.dp_pinning != "header":
            return {}
        return {"X-Data-Parallel-Rank": str(self.dp_rank)}

    def priority_for(self, klass: str, level: int = 0) -> int | None:
        """The explicit priority to send for a tenant class, or None to send none (see SGLangPool.send_priority):
        the class value plus the request's prefill level (routing/engine.py: `RoutingEngine.prefill_level`)."""
        s = self.state
        if not self.caps.priority or self.send_priority == "never":
            return None
        if self.send_priority == "auto" and s.priority_scheduling is not True:
            return None
        value = self.priority_values.get(klass, DEFAULT_PRIORITY_VALUES.get(klass, 0))
        value += level
        return -value if s.low_priority_values_first else value


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
    def __init__(self, cfg: GatewayConfig, keys: Mapping[str, str | None] | None = None) -> None:
        """`keys`: each pool's upstream API key, resolved at start (gateway/secrets.py); None resolves them now
        (a named variable that is unset is a ConfigError)."""
        if keys is None:
            keys = pool_keys(cfg)
        self.targets: list[Target] = []
        self.by_pool: dict[str, list[Target]] = {}
        self._cb = cfg.circuit_breaker
        self._fixed_ranks: dict[str, int] = {}  # server -> dp_size from the config (discovery does not override)
        self._pinning: dict[str, str] = {}
        for pool in cfg.pools:
            key = keys.get(pool.name)
            ts: list[Target]
            if isinstance(pool, SGLangPool):
                pinning = "off" if pool.dp_pinning == "off" else "header" if pool.dp_pinning == "header" else "body"
                ts = []
                for r in pool.replicas:
                    ts.append(Target(pool.name, r.name, "sglang", r.url, f"{r.url}/v1", pool.model, key,
                                     pool.health_path, pool.timing, CAPABILITIES["sglang"], self._state(pool),
                                     dp_pinning=pinning, send_priority=pool.send_priority,
                                     priority_values={**DEFAULT_PRIORITY_VALUES,
                                                      **{str(k): v for k, v in pool.priority_values.items()}}))
                    self._pinning[r.name] = pinning
                    if r.dp_size is not None:
                        self._fixed_ranks[r.name] = r.dp_size
            elif isinstance(pool, VLLMPool):
                ts = []
                for r in pool.replicas:
                    st = self._state(pool)
                    st.low_priority_values_first = True  # vLLM schedules lower priority values first
                    ts.append(Target(pool.name, r.name, "vllm", r.url, f"{r.url}/v1", pool.model, key,
                                     pool.health_path, pool.timing, CAPABILITIES["vllm"], st,
                                     send_priority=pool.send_priority,
                                     priority_values={**DEFAULT_PRIORITY_VALUES,
                                                      **{str(k): v for k, v in pool.priority_values.items()}}))
            elif isinstance(pool, OpenAIPool):
                ts = [Target(pool.name, pool.name, "openai", pool.base_url, pool.base_url, pool.model, key,
                             pool.health_path, pool.timing, CAPABILITIES["openai"], self._state(pool))]
            else:
                assert isinstance(pool, LiteLLMPool)
                ts = [Target(pool.name, pool.name, "litellm", pool.api_base or "", pool.api_base or "", pool.model,
                             key, "", pool.timing, CAPABILITIES["litellm"], self._state(pool))]
            self.by_pool[pool.name] = ts
            self.targets.extend(ts)
            for t in ts:
                _log_breaker(t)
        for server, n in self._fixed_ranks.items():
            self.set_ranks(server, n)

    def _state(self, pool: SGLangPool | VLLMPool | OpenAIPool | LiteLLMPool) -> TargetState:
        return TargetState(CircuitBreaker(self._cb.failure_threshold, self._cb.cooldown_s), pool.pricing,
                           weight=pool.weight)

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
        """Engine server name -> its targets (one, or one per DP rank): the servers with an engine API to poll."""
        out: dict[str, list[Target]] = {}
        for t in self.targets:
            if t.caps.engine_loads:
                out.setdefault(t.server, []).append(t)
        return out

    def set_ranks(self, server: str, discovered: int, **facts: Any) -> list[Target]:
        """Make `server` `n` targets (n = the configured dp_size, else `discovered`; 1 with pinning off), in place in
        `by_pool` and `targets`, and record its server `facts` (SERVER_FACTS fields of TargetState) on each. The
        engine poller is the one caller with facts. Returns the server's targets."""
        unknown = set(facts) - SERVER_FACTS
        if unknown:
            raise TypeError(f"not server facts: {sorted(unknown)}")
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
            new = [dataclasses.replace(tpl, name=server if rank is None else f"{server}/dp{rank}", dp_rank=rank,
                                       state=self._rank_state(tpl.state))
                   for rank in want_ranks]
            for t in new:
                _log_breaker(t)
            _splice(self.targets, current, new)
            _splice(self.by_pool[tpl.pool], current, new)
            current = new
        for t in current:
            for k, v in facts.items():
                setattr(t.state, k, v)
        return current

    def _rank_state(self, server: TargetState) -> TargetState:
        """A new rank's state: what is about the server or the pool carries over; its own load, breaker and errors
        start fresh."""
        return dataclasses.replace(server, breaker=CircuitBreaker(self._cb.failure_threshold, self._cb.cooldown_s),
                                   engine_load=None, health_failures=0, last_error="", ejected=False,
                                   probe=ProbeGate(),
                                   misconfigured=list(server.misconfigured))


def _splice(seq: list[Target], old: list[Target], new: list[Target]) -> None:
    """Replace the `old` targets (contiguous or not) by `new` at the first old one's position, in place."""
    ids = {id(t) for t in old}
    at = next(i for i, t in enumerate(seq) if id(t) in ids)
    rest = [t for t in seq if id(t) not in ids]
    before = sum(1 for t in seq[:at] if id(t) not in ids)
    seq[:] = rest[:before] + new + rest[before:]


def _log_breaker(t: Target) -> None:
    """Every transition of `t`'s breaker as a `breaker` event line (docs/on-call.md)."""
    def changed(state: BreakerState, why: str) -> None:
        log_event("breaker", pool=t.pool, replica=t.name, state=state.value, reason=why)

    t.state.breaker.on_change = changed
