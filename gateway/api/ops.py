"""Liveness (`/healthz`, alias `/health`) and readiness on both listeners; Prometheus `/metrics` on the admin listener
only (its labels name tenants and their spend), optionally behind a scrape token (`admin.metrics_token_hashes`)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.errors import AuthenticationFailed
from gateway.state import AppState

router = APIRouter()
metrics_router = APIRouter()


def gateway_state(request: Request) -> AppState:
    """The instance's state, from either listener: the admin app reaches the main app's (`app.state.main`)."""
    app = getattr(request.app.state, "main", request.app)
    return app.state.gateway  # type: ignore[no-any-return]


def bearer_matches(request: Request, hashes: list[str]) -> bool:
    """Does the request carry `Authorization: Bearer <t>` with sha256(t) among `hashes` (constant-time compare)?"""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    return any(hmac.compare_digest(digest, h) for h in hashes)


@router.get("/healthz")
@router.get("/health")  # the alias tools probe (guidellm, SGLang's own name for liveness)
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """503 only while this instance drains (SIGTERM). A model without a routable target is reported ("degraded")
    but keeps the instance ready: every instance sees the same upstreams, so failing readiness would empty the
    Service and turn the gateway's clear 503 + Retry-After into connection errors — for every model, not just
    the one that lost its replicas (e.g. when on-call drains a pool)."""
    st = gateway_state(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    missing = [m.name for m in st.config.models
               if not any(t.routable() for p in m.pools for t in st.registry.by_pool.get(p, []))]
    # SGLang servers whose preflight failed (gateway/preflight.py): named, never a reason to fail readiness
    bad = {t.server: t.misconfigured for t in st.registry.targets if t.misconfigured}
    extra = {"misconfigured_replicas": bad} if bad else {}
    kv = st.kv_events  # routing.mode precise/hybrid: each subscription's health (docs/kv-events.md)
    if kv is not None:
        extra["kv_events"] = kv.health()
    if missing:
        return JSONResponse({"status": "degraded", "models_without_replicas": missing, **extra})
    return JSONResponse({"status": "ready", **extra})


@metrics_router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = gateway_state(request)
    scrape = st.config.admin.metrics_token_hashes
    if scrape and not bearer_matches(request, scrape + st.admin_hashes):
        raise AuthenticationFailed("/metrics: missing or invalid scrape token (admin.metrics_token_hashes).")
    return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
