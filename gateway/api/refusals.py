"""Refusals that never reached the pipeline — `/v1/models`, the Responses and Messages bridges before they call it,
the admin API, unknown paths — handed to the pipeline's one way of recording a refusal (`Accounting.refused`,
pipeline/refusal.py), so they are counted in `gateway_requests_total{status,reason}` and logged in the one-line
request log like the pipeline's own, and an auth storm or a client sending garbage is visible on every endpoint. The
pipeline marks the requests it accounts itself (`scope["state"]["accounted"]`); those are skipped.

Labels stay bounded: the tenant is a configured tenant's name or "none", the model label is always "unknown" here,
the reason comes from a fixed map of statuses, and the logged endpoint is a known path prefix. A bridge that read the
body before refusing leaves `scope["state"]["refusal"]` (api/chat_bridge.py `note_refusal`): the log line then names
the model as read and the error's code and field."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from gateway.observability.metrics import api_for_path
from gateway.pipeline.pipeline import Pipeline
from gateway.pipeline.refusal import Refused
from gateway.tenancy.policy_store import PolicyStore

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


def _tenant(policies: PolicyStore, headers: list[tuple[bytes, bytes]]) -> str:
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
    tenant = policies.index.for_key(key)
    return tenant.name if tenant is not None else "none"


def account(pipeline: Pipeline, scope: MutableMapping[str, Any], status: int, started: float) -> None:
    """Record one refusal; never raises (it runs after the response was decided)."""
    try:
        path = scope.get("path", "")
        noted = scope.get("state", {}).get("refusal") or {}
        reason = reason_of(status)
        pipeline.accounting.refused(Refused(
            scope.get("state", {}).get("request_id"), _tenant(pipeline.state.policies, scope.get("headers", [])),
            "unknown", endpoint_of(path), api_for_path(path), str(status), reason, noted.get("error") or reason, started,
            method=scope.get("method"), logged_model=noted.get("model"), timed=False))
    except Exception:
        log.exception("counting a refusal failed")
