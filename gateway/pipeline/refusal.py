"""A refusal, named and recorded the one way every refusal is, wherever it happened: `reason_for` names it (a
status and a reason from a small fixed set, a metric label), `Edge` is what the pipeline knows of a request before
its exchange exists, and `Refused` is the record `Accounting.refused` counts in `gateway_requests_total` and logs in
the one-line request log — for the pipeline's own refusals (`Refused.at_edge`) and for those of requests that never
reached it (api/refusals.py: unknown paths, the adapters' own 4xx, the admin API). An admitted request that is
refused later (rate limit, shed, budget) has an exchange: `Accounting.finish` records it, with `reason_for` too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect

from gateway.errors import GatewayError, NoCapacity, RequestTimeout, RequestTooLarge
from gateway.pipeline.call import PLAIN, Call


def upstream_reason(status: int, code: str | None = None) -> str:
    if code == "request_quarantined":  # refused before any upstream saw it
        return "quarantined"
    if 400 <= status < 500:
        return "upstream_rejected"
    return {503: "no_capacity", 504: "upstream_timeout"}.get(status, "upstream_error")


def reason_for(stage: str, err: BaseException) -> tuple[str, str]:
    """(status, reason) of a request that ended with `err` raised at `stage`. Reasons are a small fixed set (a
    metric label): invalid_http (the HTTP parser refused it: servers.py), headers_too_large, header_timeout,
    too_many_connections (the connection limits, servers.py), auth, body_too_large, body_timeout,
    invalid_body, malformed_json, invalid_request, model_not_found, pool_not_allowed, concurrency_limit, rate_limit,
    shed, flow_* (flow control's refusals: pipeline/flow.py), budget, quarantined, upstream_rejected, upstream_error, no_capacity, upstream_timeout, client_disconnect, internal.
    (Ends of admitted requests add: ok, stream_error, client_stall, shutdown — a stream cut by the shutdown —,
    idempotency — a refused Idempotency-Key — and idempotent_replay — a kept outcome sent again.)"""
    if isinstance(err, (ClientDisconnect, asyncio.CancelledError)):
        return "499", "client_disconnect"
    if not isinstance(err, GatewayError):
        return "500", "internal"
    status = str(err.status)
    if isinstance(err, RequestTooLarge):
        return status, "body_too_large"
    if isinstance(err, RequestTimeout):
        return status, "body_timeout"
    if isinstance(err, NoCapacity) and stage in ("parse", "validate"):  # the large-body pool is full (offload.py)
        return status, "no_capacity"
    by_stage = {"http": "invalid_http", "headers_too_large": "headers_too_large", "header_timeout": "header_timeout",
                "connections": "too_many_connections", "identify": "auth", "read_body": "invalid_body", "parse": "malformed_json", "validate": "invalid_request",
                "concurrency": "concurrency_limit", "rate_limit": "rate_limit", "decide": "shed", "budget": "budget"}
    if stage in by_stage:
        return status, by_stage[stage]
    if stage == "flow":  # flow_queue_full, flow_queue_timeout, flow_evicted, flow_overloaded
        return status, err.code or "flow"
    if stage == "entitlements":
        return status, "model_not_found" if err.status == 404 else "pool_not_allowed"
    return status, upstream_reason(err.status, err.code)


@dataclass
class Edge:
    """What is known of a request before its exchange exists (for counting and logging a refusal)."""

    request_id: str
    endpoint: str
    started: float
    stage: str = "identify"
    tenant: str = "none"
    model: str = "none"
    stream: bool = False
    call: Call = PLAIN  # the API adapter's (pipeline/call.py): its API label


@dataclass(frozen=True)
class Refused:
    """One refused request as it is counted and logged. Labels stay bounded: `tenant` is a configured tenant's name
    or "none", `model` a configured model's or "none"/"unknown", `reason` from `reason_for` or api/refusals.py's
    fixed map; `error` is the error's code and field, never its text (messages may quote what the client sent)."""

    request_id: str | None
    tenant: str
    model: str
    endpoint: str
    api: str
    status: str
    reason: str
    error: str
    started: float
    stream: bool = False
    method: str | None = None  # logged for a request refused outside the pipeline (any path, any method)
    logged_model: str | None = None  # the model as a bridge read it from the body: logged, never a label
    # observed in the request-duration histogram; a request that never reached the pipeline is not (its time is
    # the framework's routing, not a request's)
    timed: bool = True

    @staticmethod
    def at_edge(edge: Edge, err: BaseException) -> Refused:
        """The pipeline's refusal of a request before its exchange existed (bad key, body, JSON, model, local cap)."""
        status, reason = reason_for(edge.stage, err)
        code = (err.code or err.type) if isinstance(err, GatewayError) else type(err).__name__
        param = err.param if isinstance(err, GatewayError) else None
        return Refused(edge.request_id, edge.tenant, edge.model, edge.endpoint, edge.call.api_for(edge.endpoint), status,
                       reason, code if param is None else f"{code} ({param})", edge.started, edge.stream)
