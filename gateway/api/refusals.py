"""Refusals that never reached the chat path's accounting — `/v1/models`, the Responses and Messages bridges before
they call the chat path, the admin API, unknown paths — counted in `gateway_requests_total{status,reason}` and logged
in the one-line request log like the chat path's own, so an auth storm or a client sending garbage is visible on every
endpoint. The chat path marks the requests it accounts itself (`scope["state"]["accounted"]`); those are skipped.

Labels stay bounded: the tenant is a configured tenant's name or "none", the model label is always "unknown" here,
the reason comes from a fixed map of statuses, and the logged endpoint is a known path prefix. A bridge that read the
body before refusing leaves `scope["state"]["refusal"]` (api/chat_bridge.py `note_refusal`): the log line then names
the model as read and the error's code and field."""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

from gateway.observability.logging import log_request
from gateway.observability.metrics import api_for_path
from gateway.state import AppState

log = logging.getLogger("gateway.refusals")

REASONS = {400: "invalid_request", 401: "auth", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
           408: "body_timeout", 413: "body_too_large", 422: "invalid_request", 426: "websocket_not_supported",
           429: "rate_limit", 503: "no_capacity", 529: "no_capacity"}
ENDPOINTS = ("/v1/responses", "/v1/messages/count_tokens", "/v1/messages", "/v1/models", "/admin", "/v1/")
UNCOUNTED = frozenset({"/healthz", "/readyz", "/health", "/metrics"})  # probes: a draining 503 is no refusal


def counted(scope: MutableMapping[str, Any]) -> bool:
    return scope.get("path") not in UNCOUNTED and not scope.get("state", {}).get("accounted")


def reason_of(status: int) -> str:
    return REASONS.get(status, "internal" if status >= 500 else "invalid_request")


def endpoint_of(path: str) -> str:
    return next((e.strip("/") for e in ENDPOINTS if path.startswith(e)), "other")


def _tenant(st: AppState, headers: list[tuple[bytes, bytes]]) -> str:
    """The configured tenant whose key the request carried (Bearer or x-api-key), else "none"."""
    key = None
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else None
            break
        if k == b"x-api-key":
            key = v.decode("latin-1").strip()
    if not key:
        return "none"
    tenant = st.policies.index.for_key(key)
    return tenant.name if tenant is not None else "none"


def account(st: AppState, scope: MutableMapping[str, Any], status: int, started: float) -> None:
    """Count and log one refusal; never raises (it runs after the response was decided)."""
    try:
        reason = reason_of(status)
        tenant = _tenant(st, scope.get("headers", []))
        st.metrics.requests.labels("unknown", "none", tenant, str(status), reason, api_for_path(scope.get("path", ""))).inc()
        if st.config.observability.log_requests:
            noted = scope.get("state", {}).get("refusal") or {}
            log_request({
                "request_id": scope.get("state", {}).get("request_id"), "tenant": tenant,
                "model": noted.get("model") or "unknown",
                "endpoint": endpoint_of(scope.get("path", "")), "api": api_for_path(scope.get("path", "")),
                "method": scope.get("method"), "stream": False,
                "status": str(status), "reason": reason, "pool": "none", "replica": None, "route": None,
                "attempts": 0, "ttft_ms": None, "duration_ms": round((time.monotonic() - started) * 1000, 1),
                "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0,
                "error": noted.get("error") or reason,
            })
    except Exception:
        log.exception("counting a refusal failed")
