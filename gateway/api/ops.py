"""Liveness (`/healthz`, alias `/health`), readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

router = APIRouter()


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
    st = request.app.state.gateway
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


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
