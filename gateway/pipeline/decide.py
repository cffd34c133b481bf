"""Decide: the request as the router sees it (prefix hashes in the tenant's cache namespace, its SLA, objective and
SLA-miss behaviour, its cold-placement key: the agent session's when a bridge named one), then the router's Decision.
A `shed` decision is a 503 before any upstream work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.config import ModelRoute
from gateway.errors import GatewayError, NoCapacity
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.call import Call
from gateway.pipeline.validation import ParsedRequest
from gateway.policy_schema import Tenant
from gateway.prefix.hashing import group_key, prefix_hashes
from gateway.routing import registry
from gateway.routing.decision import Decision
from gateway.routing.pipeline import Router
from gateway.routing.request import RoutingRequest, session_group
from gateway.settings.routing import Routing
from gateway.upstreams import Target


def routing_request(r: Routing, gateway_id: str, tenant: Tenant, endpoint: str, parsed: ParsedRequest, model: str,
                    call: Call, hasher: Callable[..., list[int]] = prefix_hashes) -> RoutingRequest:
    """`gateway_id`: the gateway's own id of the request (never the client's); `model`: the served model (an alias's
    route name). `hasher`: text-chunk hashes (routing.mode approximate) or token-page keys (precise/hybrid,
    kvevents/)."""
    t = tenant
    salt = t.cache_namespace(parsed.body.get("cache_salt"))
    hashes = tuple(hasher(endpoint, parsed.body, model, salt, r.chunk_tokens)) \
        if registry.spec(r.policy.type).uses_prefix else ()
    session = call.session  # an agent session (the bridges): its requests share one cold placement
    group = session_group(t.name, session) if session else group_key(hashes, hash(gateway_id))
    hint = call.affinity  # the replica that served the stored turn this one continues (Responses)
    return RoutingRequest(
        gateway_id, t.name, parsed.model, endpoint, parsed.stream, parsed.prompt_tokens,
        parsed.max_output_tokens, hashes, (t.ttft_sla_ms or r.ttft_sla_ms) / 1000.0, t.objective or r.objective,
        t.on_sla_miss or r.on_sla_miss, group,
        affinity_hint=hint[0] if hint else None, affinity_tokens=max(int(hint[1]), 0) if hint else 0,
    )


# (id(metrics), model, branch) -> (metrics, its gateway_routing_decisions_total child): labels() costs ~2 us a
# call, and both labels come from small fixed sets (entitled model names, the router's branches); the metrics
# object is held so its id cannot be reused by another app's
_DECISIONS: dict[tuple[int, str, str], tuple[Any, Any]] = {}


async def decide(router: Router, metrics: GatewayMetrics, rreq: RoutingRequest, route: ModelRoute,
                 held: Decision[Target] | None = None) -> Decision[Target]:
    """The router's decision on `rreq`, counted per served model and branch. A shed decision is returned like any
    other, so it is recorded with the request; `refuse_shed` turns it into the 503. `held`: the decision flow control
    let the request through on (made as it left the queue): kept, not redone."""
    decision = held if held is not None else await router.decide(rreq, route)
    _count(metrics, route.name, decision)  # the served model (an alias is no label)
    return decision


def _count(metrics: GatewayMetrics, model: str, decision: Decision[Target]) -> None:
    key = (id(metrics), model, decision.branch)
    hit = _DECISIONS.get(key)
    if hit is None or hit[0] is not metrics:
        if len(_DECISIONS) > 4096:  # many apps over a process's life (tests): start again
            _DECISIONS.clear()
        hit = _DECISIONS[key] = (metrics, metrics.decisions.labels(model, decision.branch))
    hit[1].inc()


def refuse_shed(name_override: Callable[[str, GatewayError], GatewayError], tenant: str,
                decision: Decision[Target]) -> None:
    """503 with Retry-After when the router shed the request (`name_override`: the control plane's, naming an
    on-call override that caused it)."""
    if decision.branch == "shed":
        retry = decision.inputs.retry_after_s or 1.0
        raise name_override(tenant, NoCapacity(
            "No replica can meet this key's TTFT target right now; retry shortly.", retry_after=retry))
