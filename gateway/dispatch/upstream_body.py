"""The body sent to one upstream target, derived from the client's."""

from __future__ import annotations

from typing import Any

from gateway.policy_schema import Tenant
from gateway.upstreams import Target


def adapt_body(body: dict[str, Any], target: Target, stream: bool, tenant: Tenant | None = None,
               level: int = 0) -> dict[str, Any]:
    """The client's body for this upstream: its model name, usage always requested on streams (for metering; the
    usage chunk is shown to the client only if it asked), and on SGLang the tenant's cache namespace (combined with
    any client salt, so no client can read another tenant's cache), the DP rank the router chose, and the tenant's
    priority class as an explicit value (never the client's) raised by the request's prefill level on this target
    (`RoutingEngine.prefill_level`). Every other field passes untouched."""
    out = dict(body)
    out["model"] = target.upstream_model
    if target.caps.dp_ranks:
        # the rank is the router's choice, never the client's: any client pin is replaced or removed
        for k in ("data_parallel_rank", "routed_dp_rank"):
            out.pop(k, None)
        pin = target.pin_field()
        if pin is not None:
            out[pin] = target.dp_rank
    if tenant is not None and target.caps.cache_salt:
        out["cache_salt"] = tenant.cache_namespace(body.get("cache_salt"))
    if tenant is not None:
        # Explicit for every class, "normal" included: with --enable-priority-scheduling SGLang gives a request
        # without `priority` the lowest value (or --default-priority-value), which would rank normal below low.
        # None (send_priority never, or auto on a server without priority scheduling): the field is left out, so a
        # server started with --abort-on-priority-when-disabled never refuses it.
        out.pop("priority", None)
        value = target.priority_for(tenant.priority, level)
        if value is not None:
            out["priority"] = value
    if stream and ("messages" in out or "prompt" in out):  # not a native Responses body: its usage comes at its end
        so = out.get("stream_options")
        out["stream_options"] = {**so, "include_usage": True} if isinstance(so, dict) else {"include_usage": True}
    return out
