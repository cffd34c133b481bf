"""Admission: may this tenant start one more request now?

1. Its concurrency slot (`max_concurrent`): taken synchronously, before the first await of the request path, so a
   burst on one instance cannot overshoot the cap; in `fleet` scope also a slot in Redis shared by every instance.
2. Its requests/min and tokens/min buckets (estimated tokens: prompt + expected output), across every instance.

Refusals are 429 with Retry-After. What was taken here is given back by accounting (the slot) or, for a request
refused later before dispatch, by the orchestrator (the rate allowance). Each step takes the store it draws on and
returns what it took; none keeps or writes the request's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import RateLimited
from gateway.observability.metrics import GatewayMetrics
from gateway.policy_schema import Tenant
from gateway.tenancy.concurrency import ConcurrencyLimiter, Slot
from gateway.tenancy.ratelimit import Bucket, RateLimiter, buckets_for

CONCURRENCY_RETRY_S = 1.0


def _over_cap(cap: int, where: str) -> RateLimited:
    return RateLimited(f"Too many concurrent requests for this key (limit {cap}{where}).", retry_after=CONCURRENCY_RETRY_S)


def take_slot(concurrency: ConcurrencyLimiter, metrics: GatewayMetrics, tenant: Tenant, request_id: str) -> Slot | None:
    """This instance's slot (None when the tenant has no cap). No await: the check and the take are one step."""
    cap = tenant.max_concurrent
    if cap is None:
        return None
    slot = concurrency.try_take(tenant.name, request_id, cap)
    if slot is None:
        metrics.refusals.labels(tenant.name, "concurrency").inc()
        raise _over_cap(cap, "")
    return slot


@dataclass(frozen=True)
class Admitted:
    """What the rate stage took (given back if the request is refused before dispatch) and the headers it owes."""

    buckets: list[Bucket] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)


NOTHING_TAKEN = Admitted()


async def take_fleet_slot(concurrency: ConcurrencyLimiter, metrics: GatewayMetrics, tenant: Tenant,
                          slot: Slot | None) -> None:
    """The fleet-wide slot (scope `fleet`, through Redis) beside this instance's `slot`; 429 when the fleet is full."""
    cap = tenant.max_concurrent
    if slot is None or cap is None or tenant.max_concurrent_scope != "fleet":
        return
    if not await concurrency.take_fleet(slot, cap):
        metrics.refusals.labels(tenant.name, "concurrency").inc()
        raise _over_cap(cap, " across the fleet")


async def admit_rate(limiter: RateLimiter, metrics: GatewayMetrics, tenant: Tenant, tokens: int) -> Admitted:
    """The tenant's requests/min and tokens/min buckets, taken across every instance; 429 with Retry-After.
    `tokens`: the request's estimate (its prompt and expected output: budget.expected_output)."""
    rl = tenant.rate_limits
    if rl.requests_per_minute is None and rl.tokens_per_minute is None:
        return NOTHING_TAKEN
    buckets = buckets_for(tenant, tokens)
    if not buckets:
        return NOTHING_TAKEN
    adm = await limiter.take(buckets)
    headers = {}
    for b, left in zip(buckets, adm.remaining):
        kind = "requests" if b.key.endswith(":req") else "tokens"
        headers[f"x-ratelimit-limit-{kind}"] = str(b.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(left)))
    if not adm.allowed:
        metrics.refusals.labels(tenant.name, "rate_limit").inc()
        err = RateLimited("Rate limit reached for this key; retry after the time in Retry-After.",
                          retry_after=max(adm.retry_after_s, 0.001))
        err.extra_headers = headers
        raise err
    return Admitted(buckets, headers)
