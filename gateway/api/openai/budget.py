"""Budget: hold the request's worst-case cost against the tenant's budgets before any upstream work.

Worst case = the dearest pool it may be sent to, no cache hit, its maximum output (`max_tokens` x `n`, or the
pool's `expected_output_tokens`). Accounting settles the reservation with the real cost. Every request gets a
reservation, so usage per tenant is recorded even without a cap (the worst case is priced only when there is one).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.api.openai.exchange import Exchange
from gateway.api.openai.validation import ParsedRequest
from gateway.errors import QuotaExceeded
from gateway.prediction.pricing import request_cost
from gateway.state import AppState
from gateway.tenancy.budget import Refusal, budget_caps


def expected_output(state: AppState, parsed: ParsedRequest, pool: str) -> int:
    n = parsed.body.get("n")
    choices = n if isinstance(n, int) and n > 1 else 1
    if parsed.max_output_tokens is not None:
        return parsed.max_output_tokens * choices
    head = state.registry.head(pool)
    return (head.timing.expected_output_tokens if head else 1000) * choices


async def reserve(state: AppState, ex: Exchange) -> None:
    worst = 0.0
    if budget_caps(ex.tenant):
        for pool in ex.route.pools:
            head = state.registry.head(pool)
            if head is not None:
                worst = max(worst, request_cost(head.pricing, ex.parsed.prompt_tokens, 0, expected_output(state, ex.parsed, pool)))
    # a lease renewed while the request runs (tenancy/fallback.py): it lives as long as the request, however long
    got = await state.budget.reserve(ex.tenant, ex.id, worst, state.config.routing.budget_lease_s)
    if isinstance(got, Refusal):
        state.metrics.refusals.labels(ex.tenant.name, "budget").inc()
        err = QuotaExceeded(f"This key's {'daily' if got.period == 'day' else 'monthly'} budget of ${got.limit:.2f} "
                            f"is spent (or held by requests in flight).", should_retry=False)
        err.extra_headers = {"retry-after": str(seconds_to_reset(got.period))}
        raise err
    ex.reservation = got


def seconds_to_reset(period: str) -> int:
    """Seconds until the budget period ends (UTC midnight / the first of next month)."""
    now = datetime.now(UTC)
    if period == "day":
        end = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        end = (now.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((end - now).total_seconds()))
