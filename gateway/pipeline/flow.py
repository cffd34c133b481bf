"""Flow control: between admission (slots, rate limits) and routing, hold the request while the fleet has no room
for it in the fair order (gateway/flow/). Off (`flow.enabled: false`) it does nothing.

A request let through after waiting carries the routing decision it was let through on (made then, against the
fleet as it was then); `decide.py` keeps it rather than deciding again. Refusals are the API's own errors: 429
`flow_queue_full` (this key's queue is full), 503 `flow_queue_timeout` / `flow_evicted` / `flow_overloaded`, each
with Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config import ModelRoute
from gateway.flow.gate import bound
from gateway.flow.runtime import FlowGate, FlowRefused
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.validation import ParsedRequest
from gateway.policy_schema import Tenant
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.settings.pools import PoolTiming
from gateway.upstreams import Target

BAND_HEADER = "x-gateway-band"


@dataclass(frozen=True)
class Passed:
    """How the request passed flow control: the decision it was let through on after waiting (None: not held, the
    decide stage routes as usual), the headers it owes the client (its band, the time it waited), and what it adds
    to its engine priority (`FlowController.engine_boost`: its band's, and more while its flow is under its share;
    sent only where the target schedules by priority)."""

    decision: Decision[Target] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    boost: int = 0


async def hold(gate: FlowGate, metrics: GatewayMetrics, tenant: Tenant, gateway_id: str, client_band: str | None,
               rreq: RoutingRequest, route: ModelRoute, parsed: ParsedRequest, timing: PoolTiming,
               expected_output: int) -> Passed:
    """Wait the request's turn (`client_band`: its x-gateway-band, honoured only for bands its policy lists;
    `timing`, `expected_output`: of the route's first pool). Raises the API's refusal."""
    pol = tenant.flow
    band = gate.band_of(pol.band, pol.client_bands, client_band)
    t = gate.ctl.ticket(gateway_id, tenant.name, band, pol.weight, parsed.prompt_tokens, expected_output, gate.clock(),
                        rreq.ttft_sla_s, pol.queue_timeout_s, lead_s=bound(rreq, timing, gate.cfg.queue_for(band)))
    try:
        decision = await gate.hold(t, rreq, route, timing, pol.max_queued)
    except FlowRefused as e:
        metrics.refusals.labels(tenant.name, f"flow_{e.refusal.reason}").inc()
        raise e.error() from None
    headers = {BAND_HEADER: gate.cfg.bands[band].name}
    if decision is None:
        return Passed(None, headers, t.boost)
    if t.granted_at is not None:
        headers["x-gateway-flow-wait-ms"] = str(int((t.granted_at - t.arrived) * 1000))
    return Passed(decision, headers, t.boost)
