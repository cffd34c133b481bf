"""Classify a failed attempt and build the final error when every candidate failed (pure).

- upstream 4xx other than 408/429: the request is at fault -> fatal, passed to the client as-is (OpenAI shape);
- connection refused/reset, timeouts, 408/429/5xx, in-band overload before the first token: try the next candidate;
- once a byte reached the client nothing is retried (the dispatcher only retries before commit).
"""

from __future__ import annotations

from gateway.backends.base import AttemptFailed
from gateway.errors import GatewayError, NoCapacity, UpstreamError, UpstreamTimeout, upstream_client_error


def is_fatal(err: AttemptFailed) -> bool:
    return not err.retryable


def final_error(errors: list[AttemptFailed]) -> GatewayError:
    """The client-facing error after failover ran out; x-should-retry false because we already retried."""
    if errors and all(e.timeout for e in errors):
        return UpstreamTimeout(f"Upstream timed out after {len(errors)} attempt(s): {errors[-1].message}", should_retry=False)
    if errors and all(e.overloaded for e in errors):
        return NoCapacity("All replicas for this model are overloaded; retry shortly.", retry_after=2)
    last = errors[-1].message if errors else "no attempt was made"
    return UpstreamError(f"Upstream failed after {len(errors)} attempt(s): {last}", should_retry=False)


def client_error(err: AttemptFailed) -> GatewayError:
    return upstream_client_error(err.status or 400, err.message, err.param)
