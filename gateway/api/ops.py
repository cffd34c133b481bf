"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready when not draining and every model has at least one routable target."""
    st = request.app.state.gateway
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    missing = [m.name for m in st.config.models
               if not any(t.routable() for p in m.pools for t in st.registry.by_pool.get(p, []))]
    if missing:
        return JSONResponse({"status": "degraded", "models_without_replicas": missing}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
