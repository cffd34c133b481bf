"""Settings of the router (`routing:` of the gateway config): the policy with its own parameters (one model per
policy, chosen by `policy.type` — gateway/routing/registry.py lists them), the prefix index mode, the SLA defaults
and the shared state (Redis) the router reads and writes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.routing.registry import DEFAULT, POLICIES, PolicyConfig
from gateway.typed import Strict as _Strict


class KvEventsStatic(_Strict):
    """A server whose /server_info has no `kv_events` descriptor (SGLang 0.5.9): where its publisher is."""

    endpoint: str = Field(pattern=r"^tcp://[^:/]+:\d+$", description="rank 0's PUB, tcp://host:port (rank r: port + r)")
    replay_endpoint: str | None = Field(default=None, pattern=r"^tcp://[^:/]+:\d+$")
    topic: str = ""
    dp_size: int = Field(default=1, ge=1, le=1024)


class TokenizerSettings(_Strict):
    """How the gateway gets a request's token ids for precise matching (gateway/tokenizers/)."""

    kind: Literal["sim", "hf"] = Field(default="sim", description="sim: the simulator's token rule (no files); hf: "
                                       "the model's tokenizer.json and chat template from `path`")
    path: str | None = Field(default=None, description="directory holding tokenizer.json and tokenizer_config.json")
    check_engine: bool = Field(default=True, description="compare a sample with the engine's /v1/tokenize at start, "
                               "and learn how it renders tools")

    @model_validator(mode="after")
    def _path(self) -> TokenizerSettings:
        if self.kind == "hf" and not self.path:
            raise ValueError("path: required with kind hf")
        return self


class KvEventsSettings(_Strict):
    """Precise routing from SGLang's KV-cache events (docs/kv-events.md)."""

    block_size: int = Field(default=64, ge=1, description="the engines' page size (--page-size); a server whose "
                            "descriptor says otherwise is routed approximately")
    speculative_s: float = Field(default=2.0, gt=0, description="after the first token, this instance's own entry "
                                 "stands this long, until the engine's BlockStored has arrived")
    discovery_interval_s: float = Field(default=5.0, gt=0, description="re-read /server_info, resubscribe the dead")
    static: dict[str, KvEventsStatic] = Field(default_factory=dict, description="replica name -> endpoints, for "
                                              "servers without a /server_info descriptor (0.5.9)")
    tokenizer: TokenizerSettings = Field(default_factory=TokenizerSettings)


class Routing(_Strict):
    policy: PolicyConfig = Field(default_factory=lambda: POLICIES[DEFAULT].params(), description="the routing "
                                 "policy and its parameters, e.g. {type: prefix_sla_cost, recompute_weight: 14}; a "
                                 "bare name takes its defaults (gateway/routing/policies/<type>/README.md)")
    mode: Literal["approximate", "precise", "hybrid"] = Field(default="approximate", description="prefix index: "
                                                             "predicted from dispatches, from KV events, or both")
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)
    chunk_tokens: int = Field(default=256, ge=16, description="prefix hash granularity (tokens)")
    ttft_sla_ms: float = Field(default=2220, gt=0, description="default TTFT target (p95) per request")
    ttft_quantile_z: float = Field(default=0.5, ge=0, le=4, description="plan against mean + z std of the TTFT "
                                   "correction (per load regime): higher spills earlier near the knee and costs more")
    replica_correction: bool = Field(default=True, description="learn a TTFT correction per replica on top of the "
                                     "pool's, so a replica slower than its peers is predicted (and routed) as such")
    replica_correction_half_life_s: float = Field(default=30.0, gt=0, le=3600, description="a replica's own "
                                                  "correction decays towards 1 while nothing observes it")
    shortest_prefill_first: bool = Field(default=True, description="within a tenant class, the priority sent to "
                                         "SGLang servers that schedule by it rises as a request's uncached prefill "
                                         "shrinks, so cached turns are not queued behind long cold prompts")
    on_sla_miss: Literal["spill", "shed"] = "spill"
    objective: Literal["cost", "latency"] = "cost"
    speculative_ttl_s: float = Field(default=10, gt=0, description="index entry from dispatch to first token")
    residency_ttl_s: float = Field(default=900, gt=0, description="index entry after the first token")
    redis_url: str | None = Field(default=None, description="shared state; in-memory when unset (rediss:// for TLS)")
    redis_password_env: str | None = Field(default=None, description="env var holding the Redis password (e.g. from a "
                                           "Secret), used when the URL carries none; keeps it out of config files")
    redis_prefix: str = "gw:"
    redis_timeout_s: float = Field(default=0.1, gt=0, description="prefix index and load: past it, this instance's view")
    limits_redis_timeout_s: float = Field(default=1.0, gt=0,
                                          description="rate limits and budgets: past it, enforced per instance")
    control_redis_timeout_s: float = Field(default=1.0, gt=0, le=60, description="admin changes and the audit: past "
                                           "it, the change is refused with 503 and nothing is applied")
    expected_inflight: int = Field(default=256, ge=1, description="requests in flight per instance this instance is "
                                   "sized for; the Redis pool's default size follows from it")
    redis_max_connections: int | None = Field(default=None, ge=2, le=10_000, description="Redis connections per "
                                              "instance (default: max(32, expected_inflight / 2)); more calls wait")
    redis_hung_after_s: float = Field(default=3.0, gt=0, le=300, description="Redis calls that only time out count as "
                                      "Redis being away once nothing at all has succeeded for this long")
    redis_pool_timeout_s: float = Field(default=0.5, gt=0, description="wait for a free Redis connection; running "
                                        "out of it is saturation (retried), never taken for Redis being away")
    limits_fallback_share: float | None = Field(default=None, gt=0, le=1, description="while Redis is away, the "
                                                "share of a budget's remainder (and of a rate limit) one instance may "
                                                "use alone (default: 1 / the instances alive when it was last seen)")
    load_poll_s: float = Field(default=1.0, gt=0, description="engine /v1/loads reconciliation period")
    queue_drain: bool = Field(default=False, description="credit the done part of a replica's prefill queue "
                              "(more cache hits on long-prompt traffic; unstable near capacity without a spill pool)")
    concurrency_lease_s: float = Field(default=30.0, ge=1, le=600, description="fleet-wide max_concurrent: a slot "
                                       "not renewed for this long (its instance died) is freed")
    budget_lease_s: float = Field(default=60.0, gt=0, le=3600, description="a budget reservation is renewed every "
                                  "third of this while its request runs; one not renewed this long (its instance died) "
                                  "lapses")

    @model_validator(mode="before")
    @classmethod
    def _policy_shorthand(cls, data: Any) -> Any:
        """`policy: round_robin` stands for `policy: {type: round_robin}`; a policy parameter written beside `policy`
        (where it lived before each policy had its own section) is refused with where it goes now."""
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("policy"), str):
            data = {**data, "policy": {"type": data["policy"]}}
        for name, s in POLICIES.items():
            for field in (s.params.model_fields.keys() - {"type"}) & data.keys():
                raise ValueError(f"{field}: a parameter of policy {name}: set it as routing.policy.{field} "
                                 f"(policy: {{type: {name}, {field}: ...}})")
        return data

    @model_validator(mode="after")
    def _pool_wait(self) -> Routing:
        if self.redis_pool_timeout_s >= self.limits_redis_timeout_s:
            raise ValueError("redis_pool_timeout_s: must be below limits_redis_timeout_s (a saturated pool is waited "
                             "on, and retried, within it)")
        return self

    @model_validator(mode="after")
    def _kv_events(self) -> Routing:
        if self.mode != "approximate" and self.chunk_tokens % self.kv_events.block_size:
            raise ValueError(f"chunk_tokens: must be a multiple of kv_events.block_size ({self.kv_events.block_size}) "
                             f"with mode {self.mode}")
        return self
