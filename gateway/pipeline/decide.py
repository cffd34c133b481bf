"""Decide: the request as the router sees it (prefix hashes in the tenant's cache namespace, its SLA, objective and
SLA-miss behaviour, its cold-placement key: the agent session's when a bridge named one), then the router's Decision.
A `shed` decision is a 503 before any upstream work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.config import Routing
from gateway.errors import NoCapacity
from gateway.pipeline.exchange import Exchange
from gateway.prefix.hashing import group_key, prefix_hashes
from gateway.routing import registry
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest, session_group
from gateway.state import AppState
from gateway.upstreams import Target


def routing_request(r: Routing, ex: Exchange, hasher: Callable[..., list[int]] = prefix_hashes) -> RoutingRequest:
    """`hasher`: text-chunk hashes (routing.mode approximate) or token-page keys (precise/hybrid, kvevents/)."""
    t = ex.tenant
    salt = t.cache_namespace(ex.parsed.body.get("cache_salt"))
    hashes = tuple(hasher(ex.endpoint, ex.parsed.body, ex.route.name, salt, r.chunk_tokens)) \
        if registry.spec(r.policy.type).uses_prefix else ()
    session = ex.call.session  # an agent session (the bridges): its requests share one cold placement
    group = session_group(t.name, session) if session else group_key(hashes, hash(ex.id))
    hint = ex.call.affinity  # the replica that served the stored turn this one continues (Responses)
    return RoutingRequest(
        ex.id, t.name, ex.parsed.model, ex.endpoint, ex.parsed.stream, ex.parsed.prompt_tokens,
        ex.parsed.max_output_tokens, hashes, (t.ttft_sla_ms or r.ttft_sla_ms) / 1000.0, t.objective or r.objective,
        t.on_sla_miss or r.on_sla_miss, group,
        affinity_hint=hint[0] if hint else None, affinity_tokens=max(int(hint[1]), 0) if hint else 0,
    )


# (id(metrics), model, branch) -> (metrics, its gateway_routing_decisions_total child): labels() costs ~2 us a
# call, and both labels come from small fixed sets (entitled model names, the router's branches); the metrics
# object is held so its id cannot be reused by another app's
_DECISIONS: dict[tuple[int, str, str], tuple[Any, Any]] = {}


async def decide(state: AppState, ex: Exchange,
                 held: tuple[RoutingRequest, Decision[Target]] | None = None) -> tuple[RoutingRequest, Decision[Target]]:
    """What was routed and the router's decision (counted per served model and branch). A shed decision is returned
    like any other, so it is recorded with the request; `refuse_shed` turns it into the 503. `held`: the routing
    request and decision flow control let the request through on (made as it left the queue): kept, not redone."""
    if held is not None:
        rreq, decision = held
    else:
        rreq = await state.cpu.run(ex.body_bytes, routing_request, state.config.routing, ex, state.prefix_hasher)
        decision = await state.router.decide(rreq, ex.route)
    key = (id(state.metrics), ex.route.name, decision.branch)  # the served model (an alias is no label)
    hit = _DECISIONS.get(key)
    if hit is None or hit[0] is not state.metrics:
        if len(_DECISIONS) > 4096:  # many apps over a process's life (tests): start again
            _DECISIONS.clear()
        hit = _DECISIONS[key] = (state.metrics, state.metrics.decisions.labels(ex.route.name, decision.branch))
    hit[1].inc()
    return rreq, decision


def refuse_shed(state: AppState, tenant: str, decision: Decision[Target]) -> None:
    """503 with Retry-After when the router shed the request (naming an on-call override that caused it)."""
    if decision.branch == "shed":
        retry = decision.inputs.retry_after_s or 1.0
        raise state.control.name_override(tenant, NoCapacity(
            "No replica can meet this key's TTFT target right now; retry shortly.", retry_after=retry))
