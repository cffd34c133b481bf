"""The body sent to one upstream target, derived from the client's."""

from __future__ import annotations

from typing import Any

from gateway.tenancy.policy_schema import Tenant
from gateway.upstreams import Target


def adapt_body(body: dict[str, Any], target: Target, stream: bool, tenant: Tenant | None = None) -> dict[str, Any]:
    """The client's body for this upstream: its model name, usage always requested on streams (for metering; the
    usage chunk is shown to the client only if it asked), and on SGLang the tenant's cache namespace (combined with
    any client salt, so no client can read another tenant's cache) and its priority class (never the client's).
    Every other field passes untouched."""
    out = dict(body)
    out["model"] = target.upstream_model
    if tenant is not None and target.kind == "sglang":
        out["cache_salt"] = tenant.cache_namespace(body.get("cache_salt"))
    if tenant is not None:
        # SGLang's scheduler default is 0; only a non-default class is sent, so servers started with
        # --abort-on-priority-when-disabled never see the field from normal tenants
        out.pop("priority", None)
        if tenant.priority != "normal" and target.kind == "sglang":
            out["priority"] = tenant.priority_value
    if stream:
        so = out.get("stream_options")
        out["stream_options"] = {**so, "include_usage": True} if isinstance(so, dict) else {"include_usage": True}
    return out
