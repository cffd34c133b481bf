"""The gateway's Prometheus metrics (one registry per app, so several apps can live in one process).

Under `gateway serve --workers N` (PROMETHEUS_MULTIPROC_DIR set by the supervisor before any worker starts) every
value lives in a per-process file and `render` sums them over the workers: counters and histograms add up, gauges
of load (in flight, queued) add up over the live workers, gauges of a replica's state (healthy, ejected, breaker
open) show the value a worker set last. Collectors that compute at scrape time (the KV-event subscriptions) are
those of the process answering the scrape."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# The API the client spoke (a bounded label): the chat path's two, the two bridged onto it, else "other" (a refusal
# on another path, e.g. /v1/models or an unknown one).
APIS = ("chat", "completions", "responses", "messages", "other")
_API_PATHS = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/responses", "responses"),
              ("/v1/messages", "messages"))


def api_for_path(path: str) -> str:
    return next((api for prefix, api in _API_PATHS if path.startswith(prefix)), "other")


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80, 160, 320)

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        # every request, refused or served: status = HTTP status sent (499: the client left first); reason = a
        # bounded set (pipeline/refusal.py reason_for: ok, auth, malformed_json, rate_limit, shed, stream_error, ...);
        # api = APIS
        self.requests = Counter("gateway_requests", "Requests by outcome",
                                ["model", "pool", "tenant", "status", "reason", "api"], registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "Time to first token seen by the client",
                              ["model", "pool", "tenant", "api"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("gateway_request_duration_seconds", "Whole request duration",
                                 ["model", "pool", "tenant", "api"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("gateway_upstream_errors", "Failed upstream attempts",
                                       ["pool", "replica", "kind"], registry=r)
        self.retries = Counter("gateway_retries", "Attempts beyond the first, per pool tried", ["pool"], registry=r)
        self.inflight = Gauge("gateway_inflight_requests", "Admitted requests not yet finished, on this instance",
                              ["tenant"], registry=r, multiprocess_mode="livesum")
        # type = uncached_prompt | cached_prompt | completion: disjoint, so summing by type is the total
        self.tokens = Counter("gateway_tokens", "Tokens from upstream usage (clamped)", ["model", "pool", "tenant", "type"],
                              registry=r)
        self.usage_anomalies = Counter("gateway_upstream_usage_anomalies", "Upstream usage values clamped",
                                       ["pool", "kind"], registry=r)
        self.accounting_failures = Counter("gateway_accounting_failures", "End-of-request steps that failed (logged)",
                                           ["step"], registry=r)
        self.cost = Counter("gateway_cost_usd", "Cost from real usage", ["model", "pool", "tenant"], registry=r)
        self.decisions = Counter("gateway_routing_decisions", "Routing decisions by branch", ["model", "branch"], registry=r)
        self.replica_healthy = Gauge("gateway_replica_healthy", "1 if the last health check passed", ["pool", "replica"], registry=r, multiprocess_mode="livemostrecent")
        self.replica_share = Counter("gateway_replica_requests", "Attempts sent to each replica (traffic share)",
                                     ["pool", "replica"], registry=r)
        self.sla = Counter("gateway_sla_requests", "Requests whose TTFT met or missed the tenant's SLA (streams: "
                           "observed; non-streamed: response time minus estimated decode time)",
                           ["tenant", "outcome"], registry=r)
        self.cached_predicted = Counter("gateway_cached_tokens_predicted", "Cached prompt tokens the router predicted",
                                        ["pool"], registry=r)
        self.cached_reported = Counter("gateway_cached_tokens_reported", "Cached prompt tokens the engines reported",
                                       ["pool"], registry=r)
        self.index_corrections = Counter("gateway_prefix_index_corrections", "Index entries invalidated by engine usage",
                                         ["pool"], registry=r)
        self.redis_rtt = Histogram("gateway_redis_rtt_seconds", "Redis round trips of the prefix index",
                                   buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self.routing_lookup = Histogram("gateway_routing_lookup_seconds", "Prefix match + load snapshot before a decision",
                                        buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
                                        registry=r)
        # kind: api/chat_bridge.py DROP_KINDS (what a bridge left out of a served request, and why)
        self.bridge_dropped = Counter("gateway_bridge_dropped", "Request parts the Responses and Messages bridges left "
                                      "out of a served request", ["api", "kind"], registry=r)
        self.refusals = Counter("gateway_tenant_refusals", "Requests refused by a tenant's rate limit or budget",
                                ["tenant", "reason"], registry=r)
        self.policy_reloads = Counter("gateway_policy_reloads", "Policy reloads by result", ["result"], registry=r)
        self.shared_state_fallbacks = Counter("gateway_shared_state_fallbacks", "Shared-state calls served from this "
                                              "instance's state instead of Redis, by user and why (away, unavailable, "
                                              "error, timeout, saturated)", ["what", "reason"], registry=r)
        self.settlements_pending = Gauge("gateway_budget_settlements_pending", "Budget settlements queued for Redis "
                                         "(replayed when it answers)", registry=r, multiprocess_mode="livesum")
        self.poison_quarantined = Counter("gateway_poison_quarantined", "Request bodies quarantined after timing out "
                                          "or breaking the connection on two replicas", registry=r)
        self.quarantine_refusals = Counter("gateway_quarantine_refusals", "Requests refused because their body is "
                                           "quarantined", registry=r)
        self.request_caused_failures = Counter("gateway_request_caused_failures", "Upstream failures judged the "
                                               "request's fault (returned as 4xx, not counted against the replica)",
                                               ["pool"], registry=r)
        self.ejections = Counter("gateway_replica_ejections", "Replicas taken out of routing by the dispatcher",
                                 ["pool", "replica", "reason"], registry=r)
        # per replica: the replica label is bounded by the configuration (its replicas, and the DP ranks each server
        # reports, capped by preflight.MAX_RANKS), never by traffic
        self.replica_ttft = Histogram("gateway_replica_ttft_seconds", "Time to first token observed per replica "
                                      "(streams, from the request's send to the replica to its first token)", ["pool", "replica"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.replica_itl = Histogram("gateway_replica_itl_seconds", "Mean inter-token latency of each served stream, "
                                     "per replica", ["pool", "replica"], buckets=ITL_BUCKETS, registry=r)
        self.replica_ttft_predicted = Gauge("gateway_replica_ttft_predicted_seconds", "The router's predicted TTFT for "
                                            "the last request dispatched to the replica", ["pool", "replica"],
                                            registry=r, multiprocess_mode="livemostrecent")
        self.replica_correction = Gauge("gateway_replica_ttft_correction", "The replica's own learned TTFT correction "
                                        "(1: as its pool; 6: six times slower than the pool's model)",
                                        ["pool", "replica"], registry=r, multiprocess_mode="livemostrecent")
        self.replica_ejected = Gauge("gateway_replica_ejected", "1 while the replica is ejected as a latency outlier",
                                     ["pool", "replica"], registry=r, multiprocess_mode="livemostrecent")
        self.offload_steps = Counter("gateway_offload_steps", "CPU steps of large bodies (parse, translate, validate, "
                                     "hash, tokenize) run off the event loop, or refused with 503 while the pool was "
                                     "full", ["result"], registry=r)
        self.offload_queued = Gauge("gateway_offload_queued", "Large-body CPU steps running or waiting", registry=r, multiprocess_mode="livesum")
        self.breaker_open = Gauge("gateway_replica_circuit_open", "1 while the circuit breaker is open", ["pool", "replica"], registry=r, multiprocess_mode="livemostrecent")

    def render(self) -> bytes:
        shared = os.environ.get(MULTIPROC_ENV)
        if not shared:
            return generate_latest(self.registry)
        every = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(every, shared)  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
        names = {m.name for m in every.collect()}
        # this process's scrape-time collectors: their families are in no worker's files (a metric made with
        # prometheus_client's classes is, from its creation, so it is never counted twice)
        own = [m for m in self.registry.collect() if m.name not in names and m.samples]
        every.register(_Families(own))
        return generate_latest(every)


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Children:
    """`owner.<name>.labels(*values)`, looked up once per label set: prometheus' `labels()` checks, converts and
    locks on every call (~2 us), and the end of every request makes several. For label sets bounded by the
    configuration and a fixed vocabulary (model, pool, tenant, status, reason, api), as prometheus keeps a child
    per set anyway; never for a metric whose children are removed. The metric is read from its owner on each call,
    so one put in its place (a test's) is the one counted into."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name
        self._metric: Any = None
        self._by: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        metric = getattr(self.owner, self.name)
        if metric is not self._metric:
            self._metric, self._by = metric, {}
        child = self._by.get(values)
        if child is None:
            child = self._by[values] = metric.labels(*values)
        return child


class _Families:
    """A collector that yields fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
