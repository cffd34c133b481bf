"""Budget: hold the request's worst-case cost against the tenant's budgets before any upstream work.

Worst case = the most the request can be billed: at the dearest pool it may be sent to, no cache hit, its usage
bound (`usage_bound`: the prompt tokens an upstream may claim for it, and `max_tokens` x its sequences; without
`max_tokens` the pool's `expected_output_tokens` instead). The upstream's usage is clamped to the same bound
(relay.py), so a request with `max_tokens` is never billed past its reservation. Accounting settles the reservation
with the real cost. Every request gets a reservation, so usage per tenant is recorded even without a cap (the worst
case is priced only when there is one).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.config import GatewayConfig
from gateway.errors import QuotaExceeded
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.usage import UsageBound, bound_for
from gateway.pipeline.validation import ParsedRequest, limits_for
from gateway.policy_schema import Tenant
from gateway.prediction.pricing import request_cost
from gateway.tenancy.budget import BudgetLedger, Refusal, Reservation, budget_caps
from gateway.upstreams import UpstreamRegistry


def expected_output(registry: UpstreamRegistry, parsed: ParsedRequest, pool: str) -> int:
    n = parsed.body.get("n")
    choices = n if isinstance(n, int) and n > 1 else 1
    if parsed.max_output_tokens is not None:
        return parsed.max_output_tokens * choices
    head = registry.head(pool)
    return (head.timing.expected_output_tokens if head else 1000) * choices


def usage_bound(config: GatewayConfig, registry: UpstreamRegistry, parsed: ParsedRequest, pools: list[str]) -> UsageBound:
    """The most the request can have used (pipeline/usage.py) on `pools` (the one that served it, once known)."""
    u = config.usage_bounds
    context = limits_for(config, pools, registry).context_tokens
    return bound_for(parsed.body, parsed.prompt_tokens, parsed.max_output_tokens, context, u.prompt_factor,
                     u.prompt_slack_tokens, u.media_tokens, u.max_output_tokens)


def worst_case(config: GatewayConfig, registry: UpstreamRegistry, tenant: Tenant, parsed: ParsedRequest,
               pools: list[str]) -> float:
    """The most the request can be billed on any of `pools` (0 when the tenant has no budget cap: not priced)."""
    worst = 0.0
    if budget_caps(tenant):
        for pool in pools:
            head = registry.head(pool)
            if head is not None:
                prompt = usage_bound(config, registry, parsed, [pool]).prompt
                worst = max(worst, request_cost(head.pricing, prompt, 0, expected_output(registry, parsed, pool)))
    return worst


async def reserve(ledger: BudgetLedger, metrics: GatewayMetrics, tenant: Tenant, request_id: str, worst: float,
                  lease_s: float) -> Reservation:
    """`worst` held against the tenant's budgets under the gateway's `request_id` (429 insufficient_quota when it
    does not fit)."""
    # a lease renewed while the request runs (tenancy/fallback.py): it lives as long as the request, however long
    got = await ledger.reserve(tenant, request_id, worst, lease_s)
    if isinstance(got, Refusal):
        metrics.refusals.labels(tenant.name, "budget").inc()
        err = QuotaExceeded(f"This key's {'daily' if got.period == 'day' else 'monthly'} budget of ${got.limit:.2f} "
                            f"is spent (or held by requests in flight).", should_retry=False)
        err.extra_headers = {"retry-after": str(seconds_to_reset(got.period))}
        raise err
    return got


def seconds_to_reset(period: str) -> int:
    """Seconds until the budget period ends (UTC midnight / the first of next month)."""
    now = datetime.now(UTC)
    if period == "day":
        end = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        end = (now.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((end - now).total_seconds()))
