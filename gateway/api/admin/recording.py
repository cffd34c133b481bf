"""The traffic recording of this instance (gateway replay's format), behind the admin token like the rest of `/admin`.

GET  /admin/recording                      status
POST /admin/recording/start|stop           start a new recording at `recording.path` (truncated) / stop it; this
                                           instance only (each writes its own file), audited
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from gateway.api.admin.routes import Admin, _state, require_admin
from gateway.control.store import StoreUnavailable
from gateway.errors import Conflict

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/recording")
async def recording(request: Request) -> Response:
    rec = _state(request).recorder
    return JSONResponse(rec.status() if rec is not None else {"path": None, "recording": False})


@router.post("/recording/{action}")
async def recording_action(request: Request, action: Literal["start", "stop"], who: Admin) -> Response:
    """Per instance, not through the control plane: the file is this instance's. Audited like every change (the
    audit log is shared, so on-call sees which instance recorded what)."""
    st = _state(request)
    rec = st.recorder
    if rec is None or rec.path is None:
        raise Conflict("Recording needs recording.path in this instance's config; the admin API never picks a file.",
                       param="recording.path")
    was = rec.enabled
    if action == "start":
        if rec.enabled:
            raise Conflict(f"Already recording to {rec.path} ({rec.requests} requests); stop it first (a start "
                           "truncates the file).", param="action")
        rec.start()
    else:
        rec.stop()
    try:
        await st.control.store.audit({"at": time.time(), "who": who, "what": f"recording_{action}",
                                      "path": str(rec.path), "requests": rec.requests,
                                      "before": {"recording": was}, "after": {"recording": rec.enabled}})
    except StoreUnavailable:
        pass  # the recording itself is local and already switched; the audit entry is best effort while Redis is away
    return JSONResponse(rec.status())

