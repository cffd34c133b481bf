"""Every way a request ends maps to one status and one reason from a small fixed set: the reason is a metric label,
so it must never carry a client-chosen value, and each stage's refusal must be told apart on a dashboard."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from gateway.errors import (
    AuthenticationFailed,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    PermissionDenied,
    QuotaExceeded,
    RateLimited,
    RequestTimeout,
    RequestTooLarge,
    UpstreamError,
    UpstreamTimeout,
    upstream_client_error,
)
from gateway.pipeline.refusal import reason_for


@pytest.mark.parametrize("stage, err, expected", [
    ("identify", AuthenticationFailed("bad key"), ("401", "auth")),
    ("read_body", RequestTooLarge("big"), ("413", "body_too_large")),
    ("read_body", RequestTimeout("slow"), ("408", "body_timeout")),
    ("parse", InvalidRequest("not JSON"), ("400", "malformed_json")),
    ("parse", NoCapacity("large-body pool full"), ("503", "no_capacity")),  # offload.max_queued: not the body's fault
    ("validate", InvalidRequest("bad n", param="n"), ("400", "invalid_request")),
    ("entitlements", ModelNotFound("no such model"), ("404", "model_not_found")),
    ("entitlements", PermissionDenied("pin"), ("403", "pool_not_allowed")),
    ("concurrency", RateLimited("cap"), ("429", "concurrency_limit")),
    ("rate_limit", RateLimited("rpm"), ("429", "rate_limit")),
    ("decide", NoCapacity("shed"), ("503", "shed")),
    ("budget", QuotaExceeded("spent"), ("429", "budget")),
    ("dispatch", upstream_client_error(400, "bad tool"), ("400", "upstream_rejected")),
    ("dispatch", UpstreamError("all failed"), ("502", "upstream_error")),
    ("dispatch", NoCapacity("none routable"), ("503", "no_capacity")),
    ("dispatch", UpstreamTimeout("slow"), ("504", "upstream_timeout")),
    ("read_body", ClientDisconnect(), ("499", "client_disconnect")),
    ("decide", asyncio.CancelledError(), ("499", "client_disconnect")),
    ("budget", RuntimeError("bug"), ("500", "internal")),
    ("dispatch", GatewayError("internal"), ("500", "upstream_error")),
])
def test_each_end_has_one_status_and_reason(stage, err, expected):
    assert reason_for(stage, err) == expected
