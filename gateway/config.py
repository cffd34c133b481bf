"""The gateway config: models -> pools -> replicas/endpoints, pricing, tenants, timeouts. YAML, validated at load.

Parse (YAML) -> default and validate (pydantic, unknown fields rejected) -> cross-check references. Every error
names the field path, e.g. ``pools[1].replicas[0].url: Input should be a valid URL``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gateway.flow.settings import FlowControl
from gateway.policy_schema import Tenant
from gateway.routing.registry import POLICIES
from gateway.settings.pools import GpuHourPricing as GpuHourPricing
from gateway.settings.pools import LiteLLMPool as LiteLLMPool
from gateway.settings.pools import ModelRoute as ModelRoute
from gateway.settings.pools import OpenAIPool as OpenAIPool
from gateway.settings.pools import PerTokenPricing as PerTokenPricing
from gateway.settings.pools import Pool as Pool
from gateway.settings.pools import PoolTiming as PoolTiming
from gateway.settings.pools import Pricing as Pricing
from gateway.settings.pools import Replica as Replica
from gateway.settings.pools import SGLangPool as SGLangPool
from gateway.settings.pools import VLLMPool as VLLMPool
from gateway.settings.routing import KvEventsSettings as KvEventsSettings
from gateway.settings.routing import KvEventsStatic as KvEventsStatic
from gateway.settings.routing import Routing as Routing
from gateway.settings.routing import TokenizerSettings as TokenizerSettings
from gateway.typed import Strict as _Strict
from gateway.typed import sha256_hex_list, unique_names


class ConfigError(ValueError):
    """The config file cannot be used; the message names the file and the field."""


class Timeouts(_Strict):
    connect: float = Field(default=2.0, gt=0)
    first_byte: float = Field(default=120.0, gt=0, description="request sent -> first token (streams) or response")
    idle: float = Field(default=30.0, gt=0, description="max gap between stream chunks")
    total: float = Field(default=540.0, gt=0, description="whole request, below the SDK's 600 s")
    body_read: float = Field(default=5.0, gt=0, description="max gap between reads of the client's request body, "
                             "and 1/12 of the most the whole body may take (a client that declares more bytes than "
                             "it sends gets a 408, not a held connection)")
    client_stall: float = Field(default=30.0, gt=0, description="a stream whose client has not taken a chunk for this "
                                "long is cut and its upstream request cancelled (a client that stops reading)")


class RetryPolicy(_Strict):
    max_attempts: int = Field(default=3, ge=1, description="attempts across candidates before giving up")
    same_replica_retries: int = Field(default=1, ge=0, description="immediate retries on a dropped pooled connection")
    backoff_initial: float = Field(default=0.02, ge=0)
    backoff_max: float = Field(default=0.5, ge=0)
    jitter: float = Field(default=0.05, ge=0)
    quarantine_ttl_s: float = Field(default=300.0, gt=0, le=86_400, description="a body that timed out or broke the "
                                    "connection on two replicas is refused this long (shared through Redis if set)")
    content_evidence_s: float = Field(default=60.0, gt=0, description="a 5xx on two replicas is the request's fault "
                                      "only if both served another request successfully within this window")
    stall_s: float = Field(default=5.0, gt=0, description="a replica that answered nothing this long while streamed "
                           "requests are overdue for a first byte is ejected (dispatch/ejection.py)")
    stall_min_requests: int = Field(default=2, ge=1, description="overdue requests (distinct bodies) needed to eject")


class CircuitBreaker(_Strict):
    failure_threshold: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=5.0, gt=0)


class OutlierDetection(_Strict):
    """Latency outlier ejection (dispatch/outliers.py), Envoy's outlier detection applied to TTFT and inter-token
    latency: a replica far slower than its pool's peers is taken out of routing for a while."""

    enabled: bool = True
    interval_s: float = Field(default=2.0, gt=0, le=300, description="how often a pool's replicas are compared")
    window_s: float = Field(default=20.0, gt=0, le=3600, description="observations older than this are forgotten "
                            "(admin state's per-replica figures cover it)")
    lookback_s: float = Field(default=60.0, gt=0, le=3600, description="a replica (or peer) with fewer than "
                              "min_samples observations in the window is judged on its last min_samples within this "
                              "(at least window_s): a replica with little traffic is still judged")
    min_samples: int = Field(default=8, ge=1, le=10_000, description="observations a replica (and each peer) needs "
                             "in the window before it is judged or judged against")
    probe_samples: int = Field(default=3, ge=1, le=10_000, description="requests a replica back from an "
                               "ejection takes one at a time, and is judged well on, before its full share again; "
                               "one of them slow ejects it again (it is already suspect, like a half-open breaker's "
                               "trial)")
    min_hosts: int = Field(default=3, ge=2, le=1000, description="replicas with enough samples a pool needs before "
                           "any is ejected (a peer median needs peers)")
    ttft_factor: float = Field(default=2.5, gt=1, description="eject when the replica's median TTFT residual "
                               "(observed / predicted) is this many times its peers' median")
    itl_factor: float = Field(default=2.5, gt=1, description="eject when the replica's median inter-token latency is "
                              "this many times its peers' median")
    hold_while_saturated: bool = Field(default=True, description="no latency ejection from a pool while requests wait "
                                       "in flow control for its capacity, nor for window_s after (its replicas' "
                                       "latencies then reflect how the load landed; a slow replica is still routed "
                                       "around, and one that stalls or errors still ejected); a replica on "
                                       "probation is judged regardless")
    consecutive: int = Field(default=2, ge=1, le=100, description="evaluations in a row the replica must be an "
                             "outlier (it stays far above, not one bad moment)")
    base_ejection_s: float = Field(default=30.0, gt=0, le=86_400, description="first ejection's length; each "
                                   "further one in a row is longer by this much")
    max_ejection_s: float = Field(default=300.0, gt=0, le=86_400)
    max_ejection_percent: float = Field(default=25.0, ge=0, le=100, description="of a pool's replicas that may be "
                                        "out of routing at once (ejected, unhealthy, drained or breaker open) for a "
                                        "further ejection; at least one when the pool has min_hosts")


class HealthChecks(_Strict):
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)  # SGLang's /health takes ~1 s by design
    enabled: bool = True


class Recording(_Strict):
    """Record live traffic as an anonymized trace (lengths, remapped block and tenant ids; never text) for
    `gateway replay` (gateway/recording/recorder.py)."""

    path: str | None = Field(default=None, description="JSONL file to write (truncated at start); unset = off")
    autostart: bool = Field(default=True, description="record from the start; false: only once on-call starts it "
                            "(POST /admin/recording/start)")
    max_requests: int = Field(default=100_000, ge=1, description="stop recording after this many requests")
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="stop recording past this file size")


class Shutdown(_Strict):
    """SIGTERM in the order load balancers expect: readiness fails while still serving, then stop accepting, then
    in-flight requests finish (`gateway serve --drain-timeout`)."""

    readiness_drain_s: float = Field(default=5.0, ge=0, le=600, description="seconds /readyz answers 503 while "
                                     "new requests are still served, so the balancer stops sending first")


class Observability(_Strict):
    tracing_exporter: Literal["none", "console", "otlp"] = "none"
    service_name: str = "inference-gateway"
    log_requests: bool = True


class Admin(_Strict):
    """The admin listener: the admin API, /metrics (and what else is for operators) on a port of their own, so the
    client port (and the Service that publishes it) serves the APIs alone (docs/on-call.md)."""

    token_hashes: list[str] = Field(default_factory=list, description="sha256 hex of admin tokens; empty = admin API off")
    token_hashes_env: str | None = Field(default=None, description="env var with more digests, comma-separated "
                                         "(e.g. from a Kubernetes Secret, so rotation needs no config change)")
    host: str = Field(default="127.0.0.1", min_length=1,
                      description="bind address of the admin listener (the admin API and /metrics); loopback by "
                      "default, 0.0.0.0 in a pod that a cluster-internal Service reaches")
    port: int | None = Field(default=None, ge=1, le=65535,
                             description="port of the admin listener; unset: the API port + 1 (8081 next to 8080)")
    metrics_token_hashes: list[str] = Field(default_factory=list, description="sha256 hex of scrape tokens: "
                                            "/metrics then asks for one of them (or an admin token) as a bearer "
                                            "token; empty = /metrics open on the admin listener")
    on_client_port: bool = Field(default=False, description="also serve /admin/* and /metrics on the client (API) "
                                 "port: only for a single-port setup whose client port is itself private")
    control_resync_s: float = Field(default=5.0, gt=0, description="full re-read of shared control state (pub/sub is the fast path)")

    @field_validator("token_hashes", "metrics_token_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return sha256_hex_list(v)

    def listen_port(self, api_port: int) -> int:
        """Where the admin listener binds next to a client listener on `api_port`."""
        return self.port if self.port is not None else api_port + 1


class ResponsesConfig(_Strict):
    """Stored responses of the Responses API (`store: true`), per tenant, in the shared state (docs/agent-apis.md)."""

    ttl_s: float = Field(default=86_400, ge=1, le=30 * 86_400, description="how long a stored response can be "
                         "retrieved or continued with previous_response_id")
    max_record_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="a turn whose stored form (what it "
                                  "adds to its conversation, or all of it without a parent) is larger is answered "
                                  "but not stored")
    max_per_tenant: int = Field(default=10_000, ge=1, description="stored responses per tenant; the least recently "
                                "written or continued dropped first")
    max_tenant_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="bytes stored per tenant (at most "
                                  "max_memory_bytes); past it the tenant's own least recently used turns go, so one "
                                  "tenant alone cannot evict the others'")
    max_memory_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024,
                                  description="all stored responses, every tenant together (Redis or memory)")
    retrieves_per_minute: int = Field(default=1200, ge=1, description="reads of stored responses (retrieve, input "
                                      "items, previous_response_id) per tenant and instance; more: 429")
    auto_truncate_input_tokens: int = Field(default=200_000, ge=1, description="`truncation: auto` drops the oldest "
                                            "turns until the prompt fits this many tokens")


class Idempotency(_Strict):
    """A client's explicit `Idempotency-Key` (pipeline/idempotency.py): the outcome of the first request with a
    key is returned to its repeats instead of serving (and billing) them again."""

    ttl_s: float = Field(default=86_400, ge=1, le=7 * 86_400, description="how long a key and its outcome are kept")
    max_replay_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="a larger outcome (a long stream) is "
                                  "not kept: its repeats get 409 instead of a replay")


class HttpLimits(_Strict):
    """What a client connection may hold before authentication (servers.py): the request head's size and header count,
    the time to send it, and connections per client address. Defaults follow common proxies."""

    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024, description="request line and "
                                  "headers together; larger: 431 and the connection closed (Envoy's default is 60 KiB, "
                                  "AWS ALB's 64 KB)")
    max_headers: int = Field(default=100, ge=8, le=10_000, description="header fields per request; more: 431 "
                             "(Envoy's default)")
    header_read_s: float = Field(default=20.0, gt=0, le=600, description="the whole request head must arrive within "
                                 "this from the connection's first byte (or its opening): 408 and closed otherwise "
                                 "(Apache's mod_reqtimeout header=20; nginx's client_header_timeout is 60)")
    max_connections_per_ip: int | None = Field(default=None, ge=1, description="open connections per client address; "
                                               "more are answered 429 and closed. Off by default: behind a load "
                                               "balancer every connection comes from the balancer's few addresses")


class BodyLimits(_Strict):
    """The largest request body per API, in bytes (413 past it); unset: `max_body_bytes`. An agent's Responses or
    Messages history can be raised alone without letting every chat body grow with it."""

    chat_completions: int | None = Field(default=None, ge=1024, le=1 << 30)
    completions: int | None = Field(default=None, ge=1024, le=1 << 30)
    responses: int | None = Field(default=None, ge=1024, le=1 << 30)
    messages: int | None = Field(default=None, ge=1024, le=1 << 30)


class Offload(_Strict):
    """Large bodies' CPU-heavy steps run off the event loop: the whole front half (parse, translate, validate, render,
    count, prefix-hash) in a worker process, what needs the gateway's own state (a loaded tokenizer) on a small thread
    pool: one 8 MB body then does not hold every other request for the whole of its processing (gateway/offload.py)."""

    min_body_bytes: int = Field(default=256 * 1024, ge=0, description="bodies at least this large are processed "
                                "off the event loop; smaller ones inline (a hop to a thread costs more than they do)")
    threads: int = Field(default=2, ge=1, le=64, description="threads for large bodies' steps that stay in the "
                         "gateway's process (a loaded tokenizer's, the count endpoints'; the front half when "
                         "`processes` is 0)")
    processes: int = Field(default=1, ge=0, le=64, description="worker processes running large bodies' front half "
                           "(parse, translate, validate, render, hash: on a thread it shares the gateway's GIL, and "
                           "orjson's parse holds it ~30 ms for 8 MB); spawned on the first large body; 0: on the "
                           "threads")
    process_niceness: int = Field(default=10, ge=0, le=19, description="added to the worker processes' nice value: "
                                  "where cores are short, the event loop (every other request) gets the CPU before a "
                                  "large body's parse")
    max_queued: int = Field(default=16, ge=1, le=10_000, description="large-body steps running or waiting at once; "
                            "one more is answered 503 with Retry-After (the API's own shape) instead of queueing")
    switch_interval_ms: float = Field(default=1.0, ge=0.1, le=5.0, description="the interpreter's GIL switch interval "
                                      "while large-body steps run (Python's default, 5 ms, the rest of the time): "
                                      "after each socket call the event loop waits up to this long for the GIL")


class UsageBounds(_Strict):
    """What an upstream's reported usage may claim before it is clamped (pipeline/usage.py): no upstream can bill
    a request for more than it could have used."""

    prompt_factor: float = Field(default=4.0, ge=1, le=100, description="prompt tokens may exceed the gateway's own "
                                 "count (4 characters a token) this many times: a denser tokenizer (CJK text) or "
                                 "a chat template that renders tools at length")
    prompt_slack_tokens: int = Field(default=512, ge=0, description="plus this many (template overhead)")
    media_tokens: int = Field(default=16_384, ge=0, description="plus this many per image, audio or video part")
    max_output_tokens: int = Field(default=131_072, ge=1, description="completion tokens per sequence of a request "
                                   "without max_tokens, when the pool's context length is not known")


class PolicySource(_Strict):
    """Tenant policies from a directory: `defaults.yaml` + `tenants/*.yaml` (see policies/README.md)."""

    dir: str = Field(min_length=1, description="relative paths resolve against the config file's directory")
    tenants_dir: str | None = Field(default=None, description="default <dir>/tenants; separate for two ConfigMap mounts")
    watch_interval_s: float = Field(default=1.0, gt=0, description="how often files are checked for changes")


class GatewayConfig(_Strict):
    models: list[ModelRoute] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list, description="inline tenants; or load them from `policies`")
    policies: PolicySource | None = None
    timeouts: Timeouts = Timeouts()
    retry: RetryPolicy = RetryPolicy()
    circuit_breaker: CircuitBreaker = CircuitBreaker()
    outlier_detection: OutlierDetection = OutlierDetection()
    health: HealthChecks = HealthChecks()
    observability: Observability = Observability()
    routing: Routing = Routing()
    admin: Admin = Admin()
    shutdown: Shutdown = Shutdown()
    recording: Recording = Recording()
    responses: ResponsesConfig = ResponsesConfig()
    http: HttpLimits = HttpLimits()
    idempotency: Idempotency = Idempotency()
    usage_bounds: UsageBounds = UsageBounds()
    flow: FlowControl = FlowControl()
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="every API's body limit unless "
                                "`body_limits` sets its own")
    body_limits: BodyLimits = BodyLimits()
    offload: Offload = Offload()
    max_json_depth: int = Field(default=64, ge=8, le=200, description="deeper request bodies get a 400 (orjson "
                                "re-serialises at most 254 levels)")

    def body_limit(self, api: str) -> int:
        """The body limit of one API (`chat/completions`, `completions`, `responses`, `messages`)."""
        own: int | None = getattr(self.body_limits, api.replace("/", "_"), None)
        return own if own is not None else self.max_body_bytes

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        pool_names = [p.name for p in self.pools]
        unique_names(pool_names, "pools")
        unique_names([m.name for m in self.models], "models")
        replica_names = [r.name for p in self.pools if isinstance(p, SGLangPool | VLLMPool) for r in p.replicas]
        replica_names += [r.name for p in self.pools if isinstance(p, SGLangPool) and p.disaggregation
                          for r in p.disaggregation.prefill]
        unique_names(replica_names + [p.name for p in self.pools if not isinstance(p, SGLangPool | VLLMPool)], "replicas")
        for i, m in enumerate(self.models):
            for j, p in enumerate(m.pools):
                if p not in pool_names:
                    raise ValueError(f"models[{i}].pools[{j}]: unknown pool {p!r} (known: {pool_names})")
            if len({self.pool(p).responses for p in m.pools}) > 1:  # one body shape per model: built before routing
                raise ValueError(f"models[{i}].pools: mixes responses: native and bridge pools")
        if not self.tenants and self.policies is None:
            raise ValueError("tenants: declare tenants inline or a `policies` directory")
        if self.tenants and self.policies is not None:
            raise ValueError("tenants: declare tenants inline or a `policies` directory, not both")
        check_tenants(self, self.tenants, [f"tenants[{i}]." for i in range(len(self.tenants))])
        return self

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)


def check_tenants(cfg: GatewayConfig, tenants: list[Tenant], where: list[str]) -> None:
    """Cross-references every tenant makes into the gateway config; `where[i]` prefixes tenant i's field names in
    errors (`tenants[0].` inline, `tenants/acme.yaml: ` for a policy file)."""
    model_names = {m.name for m in cfg.models}
    pool_names = {p.name for p in cfg.pools}
    unique_names([t.name for t in tenants], "tenants")
    seen: dict[str, str] = {}
    for t, loc in zip(tenants, where):
        for j, m in enumerate(t.models):
            if m not in model_names:
                raise ValueError(f"{loc}models[{j}]: unknown model {m!r}")
        for field in ("pools", "fallback_pools"):
            for j, p in enumerate(getattr(t, field) or []):
                if p not in pool_names:
                    raise ValueError(f"{loc}{field}[{j}]: unknown pool {p!r}")
        bands = [b.name for b in cfg.flow.bands]
        for field, names in (("flow.band", [t.flow.band] if t.flow.band else []), ("flow.client_bands", t.flow.client_bands)):
            for n in names:
                if n not in bands:
                    raise ValueError(f"{loc}{field}: unknown band {n!r} (flow.bands: {bands})")
        if t.max_concurrent_scope == "fleet" and not cfg.routing.redis_url:
            raise ValueError(f"{loc}max_concurrent_scope: 'fleet' needs routing.redis_url (shared state)")
        for h in t.api_key_hashes:
            if h in seen:
                raise ValueError(f"{loc}api_key_hashes: key already belongs to tenant {seen[h]!r}")
            seen[h] = t.name


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def error_location(err: Mapping[str, Any]) -> str:
    out = ""
    for part in err["loc"]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("sglang", "openai", "litellm", "per_token", "gpu_hour") or part in POLICIES:
            continue  # discriminator tags say nothing a user wrote
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def parse_config(data: object, source: str = "<config>") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: {error_location(err)}: {err['msg']}" for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    cfg = parse_config(data, str(p))
    if cfg.policies is not None:
        resolved = {k: str((p.parent / v).resolve()) for k in ("dir", "tenants_dir")
                    if (v := getattr(cfg.policies, k)) is not None and not Path(v).is_absolute()}
        cfg = cfg.model_copy(update={"policies": cfg.policies.model_copy(update=resolved)})
    return cfg
