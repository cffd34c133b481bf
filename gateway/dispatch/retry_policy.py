"""Classify a failed attempt by its cause, and build the client-facing error (pure).

Causes, and what the dispatcher does with each:
- REQUEST: an upstream 4xx (not 401/403/408/429), or a 5xx whose message blames the input (validation, overflow,
  out-of-range token ids). The client's error: returned as a 4xx naming the problem, not retried, not counted
  against the replica.
- CREDENTIALS: an upstream 401/403 — the gateway's key for that pool, never the client's: no other replica of that
  pool is tried (they share the key); a 502 that says so, with a log line for on-call.
- REPLICA: connection refused, overload (429/503): about the replica whatever the body; next candidate, breaker.
- HANG: timed out before the first byte or broke the connection. The replica, or a poison body: retried on at most
  one other replica; a body that did this on two replicas is quarantined (`quarantine.py`).
- SUSPECT_5XX: any other 5xx. The replica, or the body: a second replica decides — if it fails the same body too
  (and both replicas are serving other traffic) the request is at fault; if it succeeds, the first replica is.
Once a byte reached the client nothing is retried (the dispatcher only retries before commit).
"""

from __future__ import annotations

import re
from enum import StrEnum

from gateway.backends.base import AttemptFailed
from gateway.errors import (
    GatewayError,
    NoCapacity,
    UpstreamError,
    UpstreamTimeout,
    upstream_client_error,
)


class Cause(StrEnum):
    REQUEST = "request"
    CREDENTIALS = "credentials"
    REPLICA = "replica"
    HANG = "hang"
    SUSPECT_5XX = "suspect_5xx"


# An engine 5xx whose message says the input is at fault (SGLang's pydantic errors, numpy/int overflows on token ids,
# range checks). Deliberately narrow: a bare exception class name (KeyError...) is left to the second-replica test.
_BLAMES_INPUT = re.compile(
    r"validation error|input should be|overflow|out of (?:range|bounds|vocab)|token[ _]?ids?\b.*(?:invalid|range|vocab)"
    r"|(?:invalid|unknown) token|exceeds the (?:model's )?(?:maximum|context)|must be (?:a |an |at |in |positive|non)",
    re.IGNORECASE,
)


def classify(err: AttemptFailed) -> Cause:
    if err.connect or err.overloaded:
        return Cause.REPLICA
    if err.status in (401, 403):
        return Cause.CREDENTIALS
    if err.timeout or err.status is None:
        return Cause.HANG
    if err.status >= 500 or err.status == 408:
        return Cause.REQUEST if _BLAMES_INPUT.search(err.message) else Cause.SUSPECT_5XX
    return Cause.REQUEST


def final_error(errors: list[AttemptFailed]) -> GatewayError:
    """The client-facing error after failover ran out. x-should-retry says whether a retry can help: yes when every
    failure was about replicas (refused, overloaded: they come back); no after timeouts (possibly the body) and mixed
    failures (the gateway already tried other replicas)."""
    if errors and all(e.timeout for e in errors):
        return UpstreamTimeout(f"Upstream timed out after {len(errors)} attempt(s): {errors[-1].message}", should_retry=False)
    if errors and all(e.overloaded for e in errors):
        return NoCapacity("All replicas for this model are overloaded; retry shortly.", retry_after=2, should_retry=True)
    if errors and all(e.connect for e in errors):
        return UpstreamError(f"No replica could be reached after {len(errors)} attempt(s): {errors[-1].message}",
                             retry_after=1, should_retry=True)
    last = errors[-1].message if errors else "no attempt was made"
    return UpstreamError(f"Upstream failed after {len(errors)} attempt(s): {last}", should_retry=False)


def client_error(err: AttemptFailed) -> GatewayError:
    if err.status is not None and 400 <= err.status < 500:
        return upstream_client_error(err.status, err.message, err.param)
    # an engine 5xx caused by the input: the client's error, so a 400 that names it
    e = upstream_client_error(400, f"The model server could not process this request: {err.message}", err.param)
    e.code = "upstream_rejected_request"
    return e


def content_error(err: AttemptFailed, replicas: int) -> GatewayError:
    """The same body failed on `replicas` replicas that serve other requests: the body is at fault."""
    e = upstream_client_error(400, f"This request failed on {replicas} model server replicas that are serving other "
                              f"requests, so its content is the likely cause; it was not retried further. "
                              f"The model server said: {err.message}", err.param)
    e.code = "upstream_rejected_request"
    return e


def credentials_error(pools: list[str], err: AttemptFailed) -> GatewayError:
    names = ", ".join(repr(p) for p in pools)
    return UpstreamError(
        f"The gateway's upstream credentials for pool {names} were rejected (HTTP {err.status}). This is a gateway "
        "configuration problem, not your API key; the operators have been alerted.",
        code="upstream_credentials_rejected", should_retry=False)
