"""Flow control's metrics, on the app's registry: queue depth and wait per tenant and band, grants, refusals by
reason, and Jain's fairness index over the tenants served in the contention window."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 40, 80)


class FlowMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.depth = Gauge("gateway_flow_queue_depth", "Requests waiting in flow control on this instance",
                           ["tenant", "band"], registry=r, multiprocess_mode="livesum")
        self.oldest = Gauge("gateway_flow_queue_oldest_seconds", "Wait of the oldest queued request",
                            ["tenant", "band"], registry=r, multiprocess_mode="livemax")
        self.wait = Histogram("gateway_flow_wait_seconds", "Time from arrival to dispatch (0 when not held)",
                              ["tenant", "band"], buckets=WAIT_BUCKETS, registry=r)
        self.granted = Counter("gateway_flow_granted", "Requests let through, held or not", ["tenant", "band", "held"],
                               registry=r)
        self.refused = Counter("gateway_flow_refused", "Requests refused by flow control, by reason (queue_full, "
                               "queue_timeout, evicted, overloaded)", ["tenant", "band", "reason"], registry=r)
        self.served_cost = Counter("gateway_flow_served_cost", "Prefill-weighted tokens granted",
                                   ["tenant", "band"], registry=r)
        self.fairness = Gauge("gateway_flow_fairness", "Jain's index over the tenants' weight-normalised service "
                              "in the contention window (1: equal)", registry=r,
                              multiprocess_mode="livemostrecent")
