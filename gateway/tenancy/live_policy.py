"""Live tenant policy changes: the fields on-call may change without editing a policy file, and how such a change is
laid over the file's tenant and validated.

A change is a partial tenant policy (`{"rate_limits": {"requests_per_minute": 600}}`), merged over the tenant
exactly as a tenant file is merged over `defaults.yaml` (nested sections by key, lists replace, `null` clears a
limit), then validated by the same `Tenant` model and the same cross-checks against the gateway config as a policy
file. Nothing is applied unless the whole result is valid; the error names the field
(`rate_limits.requests_per_minute: Input should be greater than or equal to 1`).

Pure: no I/O. The control plane stores the changes (shared, versioned) and `PolicyStore` applies them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.config import GatewayConfig, check_tenants, error_location
from gateway.policy_schema import Tenant
from gateway.tenancy.policy_loader import merge

# What a live change may touch: limits, budgets, SLA and routing preferences, aliases and pools. Identity (name,
# keys), the models a tenant is entitled to and its cache namespace stay with the policy file, which is reviewed.
EDITABLE = ("rate_limits", "max_concurrent", "max_concurrent_scope", "budget", "ttft_sla_ms", "on_sla_miss",
            "objective", "priority", "max_price_per_mtok", "model_aliases", "pools", "fallback_pools")


class LivePolicyError(ValueError):
    """A change that cannot be applied; `field` is where (`rate_limits.requests_per_minute`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def view(t: Tenant) -> dict[str, Any]:
    """The editable part of a tenant's effective policy, as JSON values (what the audit log records as before and
    after)."""
    return t.model_dump(mode="json", include=set(EDITABLE))


def combine(current: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """A tenant's stored live fields after one more change (the change wins, field by field)."""
    unknown = sorted(set(change) - set(EDITABLE))
    if unknown:
        raise LivePolicyError(unknown[0], f"not a field that can be changed live (editable: {', '.join(EDITABLE)})")
    return merge(current, change)


def apply(cfg: GatewayConfig, base: Tenant, fields: dict[str, Any]) -> Tenant:
    """`base` (the tenant as its policy file defines it) with the live `fields` laid over it, validated like a
    policy file; raises LivePolicyError naming the first bad field."""
    if not fields:
        return base
    own = base.model_dump(mode="json", exclude_unset=False)
    try:
        t = Tenant.model_validate(merge(own, fields))
    except ValidationError as e:
        err = e.errors()[0]
        loc, msg = error_location(err), str(err["msg"]).removeprefix("Value error, ")
        if loc in ("", "(root)"):  # a cross-field check names its field at the start of its message (`model_aliases[0].model: ...`)
            head, sep, rest = msg.partition(": ")
            loc, msg = (head, rest) if sep and " " not in head else ("(root)", msg)
        raise LivePolicyError(loc, msg) from None
    try:
        check_tenants(cfg, [t], [""])
    except ValueError as e:
        field, _, msg = str(e).partition(": ")
        raise LivePolicyError(field, msg) from None
    return t


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Field -> [before, after] for every top-level field that differs."""
    return {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}
