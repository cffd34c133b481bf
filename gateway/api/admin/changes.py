"""Admin API for live tenant policy changes, the change history, undo and previews (same token as the rest of
`/admin`; every write goes through the control plane: shared, versioned, audited with before and after).

GET    /admin/tenants/{name}/policy          the tenant's effective policy, its file's, its live change and version
PATCH  /admin/tenants/{name}/policy[?if_version=N]
                                             a partial policy ({"rate_limits": {"requests_per_minute": 600}}) merged
                                             over the live change; validated like a policy file (400 naming the
                                             field, nothing applied); `if_version`: 409 if the change moved since
DELETE /admin/tenants/{name}/policy          drop the live change: the policy file's values serve again
GET    /admin/history?limit=N                the audit log, newest first, each entry with `undoable` / `undone_by`
POST   /admin/undo                           {"id": N} (default: the newest change not yet undone); 409 if what it set
                                             has changed since
POST   /admin/preview                        {"pool", "weight"} or {"tenant", "pin_pool"}: what recent decisions on
                                             this instance would move (nothing is changed)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import Field, model_validator
from starlette.responses import JSONResponse, Response

from gateway.api.admin.routes import Admin, _apply, _body, _proxy, _raw, _state, require_admin
from gateway.control import history
from gateway.control.state import LivePolicy
from gateway.control.store import StoreUnavailable
from gateway.errors import InvalidRequest, NoCapacity, NotFound
from gateway.pipeline.validation import parse_json
from gateway.routing.preview import preview
from gateway.tenancy import live_policy
from gateway.typed import Strict

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


def _tenant(request: Request, name: str) -> Any:
    base = _state(request).policies.base(name)
    if base is None:
        raise NotFound(f"Unknown tenant {name!r}.", param="name")
    return base


@router.get("/tenants/{name}/policy")
async def get_policy(name: str, request: Request) -> Response:
    st = _state(request)
    base = _tenant(request, name)
    live = st.control.state.policies.get(name) or LivePolicy()
    return JSONResponse({"tenant": name, "effective": live_policy.view(st.policies.index.tenants.get(name, base)),
                         "file": live_policy.view(base), "live": live.fields, "version": live.version,
                         "live_error": st.policies.live_errors.get(name), "editable": list(live_policy.EDITABLE)})


@router.patch("/tenants/{name}/policy")
async def patch_policy(name: str, request: Request, who: Admin,
                       if_version: int | None = Query(None, ge=0, le=2**53)) -> Response:
    st = _state(request)
    _tenant(request, name)
    raw = await _raw(request)
    fields = parse_json(raw, st.config.max_json_depth) if raw else {}
    if not isinstance(fields, dict) or not fields:
        raise InvalidRequest("Send a JSON object of policy fields to change, e.g. "
                             '{"rate_limits": {"requests_per_minute": 600}}.', param="body")
    entry = await _apply(st.control.set_policy(who, name, fields, if_version=if_version))
    return JSONResponse({"tenant": name, "version": entry["version"], "before": entry["before"],
                         "after": entry["after"], "audit_id": entry["id"]})


@router.delete("/tenants/{name}/policy")
async def clear_policy(name: str, request: Request, who: Admin,
                       if_version: int | None = Query(None, ge=0, le=2**53)) -> Response:
    st = _state(request)
    _tenant(request, name)
    entry = await _apply(st.control.set_policy(who, name, {}, if_version=if_version, replace=True))
    return JSONResponse({"tenant": name, "version": entry["version"], "before": entry["before"],
                         "after": entry["after"], "audit_id": entry["id"]})


@router.get("/history")
async def get_history(request: Request, limit: int = Query(50, ge=1, le=10_000)) -> Response:
    try:
        entries = await _state(request).control.store.audit_log(limit)
    except StoreUnavailable as e:
        raise NoCapacity(str(e), retry_after=1) from None
    return JSONResponse({"entries": history.annotate(entries)})


class UndoIn(Strict):
    id: int | None = Field(default=None, ge=1, le=2**53, description="audit entry id; default: the newest change")


@router.post("/undo")
async def undo(request: Request, who: Admin) -> Response:
    body = await _body(request, UndoIn)
    entry = await _apply(_state(request).control.undo(who, body.id))
    return JSONResponse({"undone": entry["undo_of"], "audit_id": entry["id"], "what": entry["what"],
                         "before": entry.get("before"), "after": entry.get("after")})


class PreviewIn(Strict):
    pool: str | None = None
    weight: float | None = Field(default=None, ge=0, le=1000)
    tenant: str | None = None
    pin_pool: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PreviewIn:
        if (self.pool is None) != (self.weight is None) or (self.tenant is None) != (self.pin_pool is None) \
                or (self.pool is None) == (self.tenant is None):
            raise ValueError("send either pool and weight, or tenant and pin_pool")
        return self


@router.post("/preview")
async def preview_change(request: Request) -> Response:
    """Dry run of a weight or pin change over this instance's recent decisions (nothing is changed)."""
    st = _state(request)
    body = await _body(request, PreviewIn)
    for pool, param in ((body.pool, "pool"), (body.pin_pool, "pin_pool")):
        if pool is not None and pool not in st.registry.by_pool:
            raise InvalidRequest(f"Unknown pool {pool!r}.", param=param)
    if body.tenant is not None and body.tenant not in st.policies.index.tenants:
        raise NotFound(f"Unknown tenant {body.tenant!r}.", param="tenant")
    past = [(r.request, r.decision) for r in list(_proxy(request).recent)
            if r.request is not None and r.decision is not None]
    out = preview(st.router.engine, past, pool=body.pool, weight=body.weight, tenant=body.tenant,
                  pin_pool=body.pin_pool)
    return JSONResponse({"change": body.model_dump(exclude_none=True), **out})
