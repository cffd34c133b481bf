"""The gateway's one error tree. Each error knows its HTTP status and OpenAI error type/code;
`api/error_handlers.py` is the only place that turns them into responses.

GatewayError
├── InvalidRequest        400 invalid_request_error (param set where known)
├── AuthenticationFailed  401 invalid_request_error / invalid_api_key
├── PermissionDenied      403 permission_error / model_not_allowed
├── ModelNotFound         404 invalid_request_error / model_not_found
├── RequestTimeout        408 invalid_request_error / request_timeout (the body did not arrive in time)
├── RequestTooLarge       413 invalid_request_error / request_too_large
├── RequestQuarantined    422 invalid_request_error / request_quarantined (a body that hung two replicas)
├── RateLimited           429 rate_limit_error / rate_limit_exceeded (+ Retry-After, x-ratelimit-*)
├── QuotaExceeded         429 insufficient_quota (budget spent; x-should-retry: false, Retry-After = period reset)
├── UpstreamError         502 server_error / upstream_error
├── NoCapacity            503 service_unavailable_error / server_is_overloaded (+ Retry-After)
└── UpstreamTimeout       504 server_error / timeout
"""

from __future__ import annotations

from typing import Any

# Client errors a retry cannot change (bad key, no permission, invalid or too large body, unknown model or path):
# answered with `x-should-retry: false`, which the OpenAI and Anthropic SDKs (and the agents built on them) obey.
FINAL_STATUSES = frozenset({400, 401, 403, 404, 405, 413, 422})


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.should_retry = should_retry
        self.extra_headers: dict[str, str] = {}
        # set by the dispatcher on errors raised after upstream attempts, so accounting can name who answered
        self.attempts = 0
        self.target: Any = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.retry_after is not None:
            secs = max(0.0, min(self.retry_after, 60.0))  # the SDK ignores Retry-After above 60 s
            h["retry-after"] = str(max(1, round(secs)))
            h["retry-after-ms"] = str(int(secs * 1000))
        should = self.should_retry
        if should is None and self.status in FINAL_STATUSES:
            should = False  # the same request gets the same answer: the SDKs retry 408/409/429/5xx only if not told
        if should is None and self.status >= 500:
            # every 5xx says whether a retry can help (the SDK retries any 5xx otherwise): an overload passes; a
            # 5xx that did not say is an internal error the same request would most likely meet again
            should = self.status == 503
        if should is not None:
            h["x-should-retry"] = "true" if should else "false"
        return {**h, **self.extra_headers}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(GatewayError):
    """An admin API name (replica, pool, tenant, audit entry) that does not exist."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(GatewayError):
    """An admin change computed from a state that has moved since (another instance wrote first), or one that
    cannot be made in the current state."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class UpgradeRequired(GatewayError):
    """A WebSocket handshake: this gateway serves its APIs over HTTP only. 426 is what clients with an HTTP fallback
    (Codex CLI's Responses WebSocket transport) take as "use HTTP here", at once and without retrying."""

    status = 426
    type = "invalid_request_error"
    code = "websocket_not_supported"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestQuarantined(GatewayError):
    """A body that timed out or broke the connection on two replicas: refused for a while (x-should-retry false)."""

    status = 422
    type = "invalid_request_error"
    code = "request_quarantined"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QuotaExceeded(GatewayError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class UpstreamError(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class NoCapacity(GatewayError):
    status = 503
    type = "service_unavailable_error"
    code = "server_is_overloaded"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "timeout"


def upstream_client_error(status: int, message: str, param: str | None = None) -> GatewayError:
    """An upstream 4xx that retrying elsewhere cannot fix, passed on with its status and an OpenAI shape."""
    err = GatewayError(message, param=param, should_retry=False)
    err.status = status
    err.type = "invalid_request_error"
    err.code = {400: None, 404: "model_not_found", 413: "request_too_large"}.get(status)
    if status == 400 and "context length" in message:
        err.code = "context_length_exceeded"
    return err
