"""The gateway's Prometheus metrics (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80, 160, 320)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("gateway_requests", "Requests by outcome", ["model", "pool", "tenant", "status"], registry=r)
        self.ttft = Histogram("gateway_ttft_seconds", "Time to first token seen by the client",
                              ["model", "pool", "tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("gateway_request_duration_seconds", "Whole request duration",
                                 ["model", "pool", "tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("gateway_upstream_errors", "Failed upstream attempts",
                                       ["pool", "replica", "kind"], registry=r)
        self.retries = Counter("gateway_retries", "Attempts beyond the first, per pool tried", ["pool"], registry=r)
        self.inflight = Gauge("gateway_inflight_requests", "Requests in flight", ["pool"], registry=r)
        self.tokens = Counter("gateway_tokens", "Tokens from upstream usage", ["model", "pool", "tenant", "type"], registry=r)
        self.cost = Counter("gateway_cost_usd", "Cost from real usage", ["model", "pool", "tenant"], registry=r)
        self.decisions = Counter("gateway_routing_decisions", "Routing decisions by branch", ["model", "branch"], registry=r)
        self.replica_healthy = Gauge("gateway_replica_healthy", "1 if the last health check passed", ["pool", "replica"], registry=r)
        self.replica_share = Counter("gateway_replica_requests", "Attempts sent to each replica (traffic share)",
                                     ["pool", "replica"], registry=r)
        self.sla = Counter("gateway_sla_requests", "Streams whose observed TTFT met or missed the tenant's SLA",
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
        self.refusals = Counter("gateway_tenant_refusals", "Requests refused by a tenant's rate limit or budget",
                                ["tenant", "reason"], registry=r)
        self.policy_reloads = Counter("gateway_policy_reloads", "Policy reloads by result", ["result"], registry=r)
        self.breaker_open = Gauge("gateway_replica_circuit_open", "1 while the circuit breaker is open", ["pool", "replica"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
