"""Admin API for on-call, behind its own bearer token (hashed in the config). Changes go through the control plane:
stored in Redis, audited (who, what, when), and applied by every instance within a second (pub/sub). The token is
checked once, by `require_admin`, a dependency of the whole router (so no route can be added without it).

GET  /admin/state                          pools, replicas (health, circuit, load, predicted TTFT, observed TTFT/ITL
                                           and error rates, own TTFT correction, outlier ejection), overrides
POST /admin/replicas/{name}/drain|undrain  stop / resume new traffic to a replica (in-flight requests finish); name:
                                           a server (all its DP ranks) or one rank (`p-0/dp1`)
POST /admin/replicas/{name}/flush-prefix   forget the router's prefix entries for a replica (a server: every rank)
PUT  /admin/pools/{name}                   {"weight": w, "pricing": {...per_token...}};  DELETE: back to the config
PUT  /admin/tenants/{name}/override        {"ttl_s", "ttft_sla_ms", "pin_pool", "objective", "on_sla_miss"}; DELETE
GET  /admin/decisions?limit=N              recent routing decisions on this instance, with their explanation
POST /admin/explain                        dry run: what the router would do with a request for a tenant
GET  /admin/flow                           flow control: queues per tenant and band, waits, fair tags, fairness
POST /admin/policies/reload                re-read the policy directory on every instance (invalid: 400, old kept)
GET  /admin/policies                       policy status (fingerprint, last error)
GET  /admin/audit?limit=N                  the audit log, newest first
GET  /admin/usage[?tenant=T]               requests, tokens and cost per tenant, today and this month

The traffic recording's routes are in `recording.py`, the live policy changes in `changes.py`, the console's views
in `fleet.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.responses import JSONResponse, Response

from gateway.api.ops import gateway_state
from gateway.config import PerTokenPricing, error_location
from gateway.control import history
from gateway.control.state import PoolOverride, TenantOverride
from gateway.control.store import StoreUnavailable
from gateway.dispatch.pd import PdBackend
from gateway.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NoCapacity,
    NotFound,
)
from gateway.pipeline.body import read_body
from gateway.pipeline.pipeline import Exchange
from gateway.pipeline.validation import parse_json, validate
from gateway.prediction.ttft import LoadView, predict_ttft, regime
from gateway.routing.engine import merged_load
from gateway.state import AppState
from gateway.tenancy.policy_loader import PolicyError
from gateway.typed import Strict
from gateway.upstreams import Target

M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> AppState:
    return gateway_state(request)


def _who(request: Request) -> str:
    """The caller, for the audit log: which admin token (by digest prefix, never the token), plus a name it gives."""
    st = _state(request)
    hashes = st.admin_hashes
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if not hashes or scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("Admin API: missing or invalid admin token.")
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    if not any(hmac.compare_digest(digest, h) for h in hashes):
        raise AuthenticationFailed("Admin API: missing or invalid admin token.")
    actor = (request.headers.get("x-admin-actor") or "").strip()[:64]
    return f"token:{digest[:8]}" + (f" ({actor})" if actor else "")


async def require_admin(request: Request) -> str:
    """The admin router's one auth check, run before a route's own parameters are validated (a caller without the
    token learns nothing, not even a 400); async so it stays on the event loop (a sync dependency takes a threadpool
    hop). FastAPI caches it per request: a handler taking `who: Admin` for the audit log gets the same value, checked
    once."""
    return _who(request)


Admin = Annotated[str, Depends(require_admin)]
# On the router, not per handler: a route added here is authenticated without having to remember it
router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


ADMIN_BODY_BYTES = 1 << 20  # admin bodies are small objects; bounded like the OpenAI surface's, in size and time


async def _raw(request: Request) -> bytes:
    return await read_body(request, ADMIN_BODY_BYTES, _state(request).config.timeouts.body_read)


async def _body(request: Request, model: type[M]) -> M:
    raw = await _raw(request)
    try:
        return model.model_validate(parse_json(raw) if raw else {})
    except ValidationError as e:
        err = e.errors()[0]
        raise InvalidRequest(f"{error_location(err)}: {err['msg']}", param=error_location(err)) from None


async def _apply(coro: Any) -> Any:
    try:
        return await coro
    except StoreUnavailable as e:
        raise NoCapacity(f"{e}; the change was not applied anywhere.", retry_after=1) from None


def _pool(st: AppState, name: str) -> str:
    if name not in st.registry.by_pool:
        raise NotFound(f"Unknown pool {name!r}.", param="name")
    return name


def _replica(st: AppState, name: str) -> Any:
    t = st.registry.get(name)
    if t is None:
        raise NotFound(f"Unknown replica {name!r}.", param="name")
    return t


# -- state --------------------------------------------------------------------------------------------------------
def _live(st: AppState, t: Target, tracked: dict[str, LoadView], uncached_tokens: int) -> tuple[LoadView, float]:
    """A target's load as this instance sees it (its own view merged with the engine's report) and the TTFT routing
    predicts there for `uncached_tokens` of prefill, with the pool's and the replica's own correction."""
    load = merged_load(tracked.get(t.name, LoadView()), t.engine_load)
    return load, predict_ttft(t.timing, load, uncached_tokens) * st.corrector.get(t.pool, regime(t.timing, load), t.name)


def _replica_truth(st: AppState, name: str) -> dict[str, Any]:
    """What the replica was observed to do (the outlier window), its own learned TTFT correction, and whether it is
    ejected as a latency outlier and why."""
    outliers = st.feedback.outliers
    if outliers is not None:
        outliers.tick()  # an ejection that ended while no traffic came is shown as ended
    return {"ttft_correction": round(st.corrector.replica_factor(name), 3),
            "observed": st.feedback.stats.view(name).as_dict(),
            "outlier": outliers.status(name) if outliers is not None else {"ejected": None}}


@router.get("/state")
async def state(request: Request, uncached_tokens: int = Query(8000, ge=0, le=10_000_000)) -> Response:
    """`predicted_ttft_s`: for a request with `uncached_tokens` to prefill, on this instance's view of the load."""
    st = _state(request)
    tracked = await st.loads.snapshot([t.name for t in st.registry.targets])
    pools = []
    for pool in st.config.pools:
        reps = []
        for t in st.registry.by_pool[pool.name]:
            load, ttft = _live(st, t, tracked, uncached_tokens)
            reps.append({"name": t.name, "healthy": t.healthy, "drained": t.drained, "routable": t.routable(),
                         "circuit": t.breaker.state.value, "incarnation": t.incarnation, "last_error": t.last_error,
                         "queued_prefill_tokens": round(load.queued_prefill_tokens), "inflight": round(load.inflight, 1),
                         "predicted_ttft_s": round(ttft, 3), **_replica_truth(st, t.name)})
        first = st.registry.head(pool.name)
        assert first is not None  # every configured pool has at least one target
        pools.append({"name": pool.name, "kind": pool.kind, "weight": first.weight,
                      "pricing": first.pricing.model_dump() if first.pricing else None, "replicas": reps})
        backend = st.backends.get("sglang")
        if isinstance(backend, PdBackend) and (pd := backend.admin_state(pool.name)) is not None:
            pools[-1]["pd"] = pd  # a PD pool: its prefill ranks, decode KV counts and branch counts
    cs = st.control.state
    return JSONResponse({"pools": pools, "prefix_index_entries": await st.index.size(),
                         "drained": sorted(cs.drained),
                         "pool_overrides": {k: v.model_dump(mode="json") for k, v in cs.pools.items()},
                         "tenant_overrides": {k: v.model_dump(mode="json") for k, v in cs.live_tenants().items()},
                         "tenant_policies": {k: v.model_dump(mode="json") for k, v in cs.policies.items() if v.fields},
                         "control_applied_at": st.control.applied_at, "policies": st.policies.status()})


@router.get("/flow")
async def flow(request: Request) -> Response:
    """Flow control on this instance: queues per tenant and band, their oldest wait, fair tags, fairness index."""
    st = _state(request)
    return JSONResponse(st.flow.snapshot() if st.flow is not None else {"enabled": False})


@router.get("/replicas")
async def replicas(request: Request) -> Response:
    """Compact replica list (kept for scripts written against the first admin API)."""
    st = _state(request)
    return JSONResponse({"replicas": [{"name": t.name, "pool": t.pool, "kind": t.kind, "healthy": t.healthy,
                                       "drained": t.drained, "circuit": t.breaker.state.value,
                                       "incarnation": t.incarnation, "last_error": t.last_error}
                                      for t in st.registry.targets],
                         "prefix_index_entries": await st.index.size()})


# -- replicas -----------------------------------------------------------------------------------------------------
@router.post("/replicas/{name:path}/{action}")
async def replica_action(name: str, action: str, request: Request, who: Admin) -> Response:
    """`name`: a server's configured name (every rank of a DP server) or one rank's target name (`p-0/dp1`); the
    path converter takes everything up to the last segment, which is the action."""
    st = _state(request)
    t = _replica(st, name)
    if action in ("drain", "undrain"):
        entry = await _apply(st.control.drain(who, name, action == "drain"))
        return JSONResponse({"replica": name, "drained": t.drained, "audit_id": entry["id"]})
    if action == "flush-prefix":
        keys = [x.index_key for x in st.registry.servers().get(name, [])] or [t.index_key]  # a server: every rank
        await _apply(st.control.change(who, "flush_prefix", {"replica": name, "keys": keys}, None,
                                       {"kind": "flush", "keys": keys}))
        await st.feedback.flushed(keys)
        return JSONResponse({"replica": name, "flushed": keys})
    raise NotFound(f"Unknown action {action!r}: drain, undrain or flush-prefix.", param="action")


# -- pools --------------------------------------------------------------------------------------------------------
MAX_USD_PER_MTOK = 10_000.0  # far above any real price; a typo like 1e308 would make every cost comparison meaningless


class PoolIn(Strict):
    """A pool override as on-call sends it: bounded, so one typo cannot poison routing cost on every instance."""

    weight: float | None = Field(default=None, ge=0, le=1000, description="0: no new traffic")
    pricing: PerTokenPricing | None = None

    @field_validator("pricing")
    @classmethod
    def _price(cls, v: PerTokenPricing | None) -> PerTokenPricing | None:
        prices = [] if v is None else [v.input_per_mtok, v.output_per_mtok, v.cached_input_per_mtok or 0.0]
        if any(p > MAX_USD_PER_MTOK for p in prices):
            raise ValueError(f"prices must be at most {MAX_USD_PER_MTOK:g} $/Mtok")
        return v


@router.put("/pools/{name}")
async def set_pool(name: str, request: Request, who: Admin) -> Response:
    st = _state(request)
    _pool(st, name)
    o = PoolOverride(**(await _body(request, PoolIn)).model_dump(exclude_none=True))
    base = next(p for p in st.config.pools if p.name == name).pricing
    if o.pricing is not None and not isinstance(base, PerTokenPricing):
        raise InvalidRequest("Only a per-token pool's price can be set here (self-hosted pools are priced by GPU-hour).",
                             param="pricing")
    entry = await _apply(st.control.set_pool(who, name, o))
    return JSONResponse({"pool": name, "override": o.model_dump(mode="json"), "audit_id": entry["id"]})


@router.delete("/pools/{name}")
async def clear_pool(name: str, request: Request, who: Admin) -> Response:
    st = _state(request)
    entry = await _apply(st.control.set_pool(who, _pool(st, name), None))
    return JSONResponse({"pool": name, "override": None, "audit_id": entry["id"]})


# -- tenants ------------------------------------------------------------------------------------------------------
class OverrideIn(Strict):
    ttl_s: float = Field(gt=0, le=7 * 86400, description="the override lapses on its own after this long")
    ttft_sla_ms: float | None = Field(default=None, gt=0, le=600_000, description="at most the SDK's 600 s timeout")
    pin_pool: str | None = None
    objective: Literal["cost", "latency"] | None = None
    on_sla_miss: Literal["spill", "shed"] | None = None
    flow_band: str | None = Field(default=None, description="flow control band (one of the config's flow.bands)")
    flow_weight: float | None = Field(default=None, gt=0, le=10_000, description="flow control weight in its band")


@router.put("/tenants/{name}/override")
async def override_tenant(name: str, request: Request, who: Admin) -> Response:
    st = _state(request)
    if name not in st.policies.index.tenants:
        raise NotFound(f"Unknown tenant {name!r}.", param="name")
    body = await _body(request, OverrideIn)
    if body.pin_pool is not None and body.pin_pool not in st.registry.by_pool:
        raise InvalidRequest(f"Unknown pool {body.pin_pool!r}.", param="pin_pool")
    bands = [b.name for b in st.config.flow.bands]
    if body.flow_band is not None and body.flow_band not in bands:
        raise InvalidRequest(f"Unknown band {body.flow_band!r} (flow.bands: {bands}).", param="flow_band")
    o = TenantOverride(expires_at=time.time() + body.ttl_s, **body.model_dump(exclude={"ttl_s"}))
    entry = await _apply(st.control.override_tenant(who, name, o))
    return JSONResponse({"tenant": name, "override": o.model_dump(mode="json"), "audit_id": entry["id"]})


@router.delete("/tenants/{name}/override")
async def clear_override(name: str, request: Request, who: Admin) -> Response:
    st = _state(request)
    if name not in st.policies.index.tenants and name not in st.control.state.tenants:
        raise NotFound(f"Unknown tenant {name!r}.", param="name")  # and nothing written to the audit log
    entry = await _apply(st.control.override_tenant(who, name, None))
    return JSONResponse({"tenant": name, "override": None, "audit_id": entry["id"]})


# -- decisions, explain -------------------------------------------------------------------------------------------
@router.get("/decisions")
async def decisions(request: Request, limit: int = Query(50, ge=1, le=500), tenant: str | None = None) -> Response:
    out = []
    for r in reversed(_proxy(request).recent):
        if tenant is None or r.tenant == tenant:
            out.append(r.explain())
            if len(out) >= max(1, limit):
                break
    return JSONResponse({"decisions": out})


def _proxy(request: Request) -> Any:
    app = getattr(request.app.state, "main", request.app)
    return app.state.proxy


@router.post("/explain")
async def explain(request: Request) -> Response:
    """Dry run: what would the router do with this request for this tenant? Nothing is dispatched or recorded.
    Body: {"tenant": name, "endpoint": "chat/completions"|"completions", "request": {...the OpenAI body...}}."""
    st = _state(request)
    body = parse_json(await _raw(request), st.config.max_json_depth)
    base = st.policies.index.tenants.get(str(body.get("tenant")))
    if base is None:
        raise InvalidRequest("Unknown tenant.", param="tenant")
    tenant = st.control.effective(base)
    endpoint = body.get("endpoint", "chat/completions")
    if endpoint not in ("chat/completions", "completions"):
        raise InvalidRequest("endpoint must be chat/completions or completions.", param="endpoint")
    if not isinstance(body.get("request"), dict):
        raise InvalidRequest("'request' must be an OpenAI request body.", param="request")
    parsed = validate(body["request"], endpoint)
    proxy = _proxy(request)
    route = proxy.route_for(tenant, parsed.model)  # the same resolution the pipeline uses (404s alike)
    ex = Exchange("explain", tenant, endpoint, parsed, route, 0.0, 0.0)
    rreq = proxy.routing_request(ex)
    decision = await st.router.decide(rreq, route, dry_run=True)
    return JSONResponse({"tenant": tenant.name, "model": parsed.model, "prompt_tokens": parsed.prompt_tokens,
                         "pools": route.pools, "sla_ms": rreq.ttft_sla_s * 1000, "decision": decision.explain(),
                         "replicas": {name: _replica_truth(st, name) for name in decision.features}})


# -- policies, audit, usage ---------------------------------------------------------------------------------------
@router.post("/policies/reload")
async def reload_policies(request: Request, who: Admin) -> Response:
    """Reload here first (so the caller sees the verdict), then ask every other instance to reload. The reload is
    audited (who, what changed per tenant) by the control plane, once for the fleet."""
    st = _state(request)
    try:
        st.policies.reload(who)
    except PolicyError as e:
        raise InvalidRequest(f"Policy reload rejected; the running policy stays in force: {e}", param="policies") from None
    await _apply(st.control.store.publish({"kind": "reload", "who": who}))
    return JSONResponse({"reloaded": True, **st.policies.status()})


@router.get("/policies")
async def policies(request: Request) -> Response:
    st = _state(request)
    tenants = st.policies.index.tenants
    return JSONResponse({**st.policies.status(), "tenant_names": sorted(tenants),
                         "model_aliases": {n: [a.model_dump(mode="json") for a in t.model_aliases]
                                           for n, t in sorted(tenants.items()) if t.model_aliases}})


@router.get("/audit")
async def audit(request: Request, limit: int = Query(100, ge=1, le=10_000)) -> Response:
    st = _state(request)
    try:
        entries = await st.control.store.audit_log(max(1, min(limit, 10_000)))
    except StoreUnavailable as e:
        raise NoCapacity(str(e), retry_after=1) from None
    return JSONResponse({"entries": history.annotate(entries)})


@router.get("/usage")
async def usage(request: Request, tenant: str | None = None) -> Response:
    st = _state(request)
    names = [tenant] if tenant is not None else sorted(st.policies.index.tenants)
    out = {}
    for name in names:
        t = st.policies.index.tenants.get(name)
        if t is None:
            raise NotFound(f"Unknown tenant {name!r}.", param="tenant")
        out[name] = {**await st.budget.usage(name), "budget": t.budget.model_dump(), "rate_limits": t.rate_limits.model_dump()}
    return JSONResponse({"tenants": out})
