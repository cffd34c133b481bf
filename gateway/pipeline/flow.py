"""Flow control: between admission (slots, rate limits) and routing, hold the request while the fleet has no room
for it in the fair order (gateway/flow/). Off (`flow.enabled: false`) it does nothing.

A request let through after waiting carries the routing decision it was let through on (made then, against the
fleet as it was then); `decide.py` keeps it rather than deciding again. Refusals are the API's own errors: 429
`flow_queue_full` (this key's queue is full), 503 `flow_queue_timeout` / `flow_evicted` / `flow_overloaded`, each
with Retry-After.
"""

from __future__ import annotations

from gateway.flow.gate import bound
from gateway.flow.runtime import FlowRefused
from gateway.pipeline.budget import expected_output
from gateway.pipeline.decide import routing_request
from gateway.pipeline.exchange import Exchange
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.state import AppState
from gateway.upstreams import Target

BAND_HEADER = "x-gateway-band"


async def hold(state: AppState, ex: Exchange) -> tuple[RoutingRequest, Decision[Target]] | None:
    """None: not held (flow control off, or no contention): the decide stage routes as usual."""
    fg = state.flow
    if fg is None:
        return None
    pol = ex.tenant.flow
    band = fg.band_of(pol.band, pol.client_bands, ex.flow_band)
    rreq = await state.cpu.run(ex.body_bytes, routing_request, state.config.routing, ex, state.prefix_hasher)
    pool = ex.route.pools[0]
    timing = state.config.pool(pool).timing
    t = fg.ctl.ticket(ex.id, ex.tenant.name, band, pol.weight, ex.parsed.prompt_tokens,
                      expected_output(state, ex.parsed, pool), fg.clock(), rreq.ttft_sla_s, pol.queue_timeout_s,
                      lead_s=bound(rreq, timing, fg.cfg.queue_for(band)))
    try:
        decision = await fg.hold(t, rreq, ex.route, timing, pol.max_queued)
    except FlowRefused as e:
        state.metrics.refusals.labels(ex.tenant.name, f"flow_{e.refusal.reason}").inc()
        raise e.error() from None
    ex.headers["x-gateway-band"] = fg.cfg.bands[band].name
    if decision is None:
        return None
    if t.granted_at is not None:
        ex.headers["x-gateway-flow-wait-ms"] = str(int((t.granted_at - t.arrived) * 1000))
    return rreq, decision
