"""Admin API (its own bearer token, hashed in the config). Today: routing explain (dry run) and replica state.
Tenancy work extends it (drain, overrides, reload, audit)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.api.openai.proxy import Exchange
from gateway.api.openai.validation import parse_json, validate
from gateway.errors import AuthenticationFailed, InvalidRequest

router = APIRouter(prefix="/admin")


def _check(request: Request) -> None:
    hashes = request.app.state.gateway.config.admin.token_hashes
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if not hashes or scheme.lower() != "bearer" or not token:
        raise AuthenticationFailed("Admin API: missing or invalid admin token.")
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    if not any(hmac.compare_digest(digest, h) for h in hashes):
        raise AuthenticationFailed("Admin API: missing or invalid admin token.")


@router.post("/explain")
async def explain(request: Request) -> Response:
    """Dry run: what would the router do with this request for this tenant? Nothing is dispatched or recorded.
    Body: {"tenant": name, "endpoint": "chat/completions"|"completions", "request": {...the OpenAI body...}}."""
    _check(request)
    st = request.app.state.gateway
    body = parse_json(await request.body())
    tenant = next((t for t in st.config.tenants if t.name == body.get("tenant")), None)
    if tenant is None:
        raise InvalidRequest("Unknown tenant.", param="tenant")
    endpoint = body.get("endpoint", "chat/completions")
    if endpoint not in ("chat/completions", "completions"):
        raise InvalidRequest("endpoint must be chat/completions or completions.", param="endpoint")
    if not isinstance(body.get("request"), dict):
        raise InvalidRequest("'request' must be an OpenAI request body.", param="request")
    parsed = validate(body["request"], endpoint)
    proxy = request.app.state.proxy
    route = proxy._route_for(tenant, parsed.model)  # noqa: SLF001 - the same resolution the proxy uses (404s alike)

    ex = Exchange("explain", tenant, endpoint, parsed, route, 0.0, 0.0)
    rreq = proxy._routing_request(ex)  # noqa: SLF001
    decision = await st.router.decide(rreq, route)
    return JSONResponse({"tenant": tenant.name, "model": parsed.model, "prompt_tokens": parsed.prompt_tokens,
                         "sla_ms": rreq.ttft_sla_s * 1000, "decision": decision.explain()})


@router.get("/replicas")
async def replicas(request: Request) -> Response:
    _check(request)
    st = request.app.state.gateway
    out = []
    for t in st.registry.targets:
        el = t.engine_load
        out.append({"name": t.name, "pool": t.pool, "kind": t.kind, "healthy": t.healthy, "drained": t.drained,
                    "circuit": t.breaker.state.value, "incarnation": t.incarnation, "last_error": t.last_error,
                    "engine_load": None if el is None else {"queued_prefill_tokens": el.queued_prefill_tokens,
                                                            "inflight": el.inflight}})
    return JSONResponse({"replicas": out, "prefix_index_entries": await st.extra["index"].size()})
