"""What the console's overview and tenant pages show, in one call each (same token as the rest of `/admin`).

GET /admin/fleet     pools and replicas: health, breaker, drain, queue (prefill tokens waiting, requests in flight),
                     KV-cache use (the engine's /v1/loads), predicted TTFT now (with the replica's own correction),
                     latency outlier ejection and why, and over this instance's recent requests: share served, median
                     observed TTFT (streams) next to what routing predicted for those same requests,
                     cache hit rate (cached / prompt tokens, from the upstream's usage); `slow` marks a replica whose
                     observed TTFT is far above its pool's median
GET /admin/tenants   per tenant: spend vs budget, requests and tokens in the last minute vs the rate limits, SLA
                     attainment over recent streams, aliases, live policy change and override
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import JSONResponse, Response

from gateway.api.admin.routes import _live, _proxy, _replica_truth, _state, require_admin
from gateway.pipeline.exchange import RecentDecision

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
SLOW_FACTOR = 2.0  # observed TTFT this many times the pool's median marks a replica slow on the overview
MIN_SAMPLES = 3  # fewer streamed requests than this: no observed TTFT is shown (one sample says little)


def _empty() -> dict[str, Any]:
    return {"requests": 0, "ttfts": [], "predicted": [], "prompt": 0, "cached": 0}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if len(xs) >= MIN_SAMPLES else None


def _served(recent: list[RecentDecision]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = defaultdict(_empty)
    for r in recent:
        if r.served_by is None:
            continue
        row = out[r.served_by]
        row["requests"] += 1
        if r.ttft_s is not None:
            row["ttfts"].append(r.ttft_s)
            cand = r.decision.features.get(r.served_by) if r.decision is not None else None
            if cand is not None:  # what routing predicted for this very request on this replica
                row["predicted"].append(cand.ttft)
        if r.prompt_tokens:
            row["prompt"] += r.prompt_tokens
            row["cached"] += r.cached_tokens or 0
    return out


@router.get("/fleet")
async def fleet(request: Request, uncached_tokens: int = Query(8000, ge=0, le=10_000_000)) -> Response:
    st = _state(request)
    recent = list(_proxy(request).recent)
    served = _served(recent)
    total = sum(v["requests"] for v in served.values()) or 1
    tracked = await st.loads.snapshot([t.name for t in st.registry.targets])
    pools = []
    for pool in st.config.pools:
        reps = []
        for t in st.registry.by_pool[pool.name]:
            load, predicted = _live(st, t, tracked, uncached_tokens)
            s = served.get(t.name) or _empty()
            ttfts = s["ttfts"]
            reps.append({
                "name": t.name, "healthy": t.healthy, "drained": t.drained, "routable": t.routable(),
                "circuit": t.breaker.state.value, "last_error": t.last_error, "misconfigured": list(t.state.misconfigured),
                "queued_prefill_tokens": round(load.queued_prefill_tokens), "inflight": round(load.inflight, 1),
                "kv_usage": round(t.state.kv_usage, 3) if t.state.kv_usage is not None else None,
                "predicted_ttft_s": round(predicted, 3),
                # its own learned TTFT correction and, if it is out as a latency outlier, why (dispatch/outliers.py)
                "ttft_correction": round(st.corrector.replica_factor(t.name), 3),
                "outlier": _replica_truth(st, t.name)["outlier"],
                "served": s["requests"], "share": round(s["requests"] / total, 3),
                "observed_ttft_s": _median(ttfts), "predicted_served_ttft_s": _median(s["predicted"]),
                "ttft_samples": len(ttfts),
                "hit_rate": round(s["cached"] / s["prompt"], 3) if s["prompt"] else None,
            })
        observed = [r["observed_ttft_s"] for r in reps if r["observed_ttft_s"] is not None]
        median = statistics.median(observed) if len(observed) >= 2 else None
        for r in reps:
            r["slow"] = bool(median and r["observed_ttft_s"] is not None and r["observed_ttft_s"] > SLOW_FACTOR * median)
        first = st.registry.head(pool.name)
        pools.append({"name": pool.name, "kind": pool.kind, "weight": first.weight if first else None,
                      "replicas": reps})
    return JSONResponse({"pools": pools, "recent_requests": len(recent), "at": time.time(),
                         "uncached_tokens": uncached_tokens})


@router.get("/tenants")
async def tenants(request: Request) -> Response:
    st = _state(request)
    now = time.time()
    recent = list(_proxy(request).recent)
    out = []
    for name, t in sorted(st.policies.index.tenants.items()):
        mine = [r for r in recent if r.tenant == name]
        last_min = [r for r in mine if now - r.at <= 60]
        streams = [r for r in mine if r.ttft_s is not None and r.request is not None]
        met = sum(1 for r in streams if r.request is not None and r.ttft_s is not None
                  and r.ttft_s <= r.request.ttft_sla_s)
        live = st.control.state.policies.get(name)
        override = st.control.state.live_tenants().get(name)
        out.append({
            "name": name, "priority": t.priority, "ttft_sla_ms": t.ttft_sla_ms,
            "usage": await st.budget.usage(name), "budget": t.budget.model_dump(),
            "rate_limits": t.rate_limits.model_dump(), "max_concurrent": t.max_concurrent,
            "last_minute": {"requests": len(last_min),
                            "tokens": sum((r.prompt_tokens or 0) for r in last_min)},
            "sla": {"streams": len(streams), "met": met,
                    "attainment": round(met / len(streams), 3) if streams else None},
            "aliases": [a.model_dump(mode="json") for a in t.model_aliases],
            "live_policy": live.fields if live else {}, "live_version": live.version if live else 0,
            "live_error": st.policies.live_errors.get(name),
            "override": override.model_dump(mode="json") if override else None,
        })
    return JSONResponse({"tenants": out})
