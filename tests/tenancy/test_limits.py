"""Rate-limit buckets and budget reservations on a fixed clock (the in-memory implementations; the Redis ones run
the same arithmetic and are checked against a real Redis in tests/tenancy/test_tenancy.py)."""

import pytest

from gateway.config import hash_key
from gateway.policy_schema import Tenant
from gateway.tenancy.budget import MemoryBudgetLedger, Refusal, Reservation, Usage
from gateway.tenancy.ratelimit import Bucket, MemoryRateLimiter, buckets_for


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def tenant(**kw) -> Tenant:
    return Tenant(name="a", api_key_hashes=[hash_key("k")], models=["m"], **kw)


async def test_bucket_allows_a_minute_burst_then_refills_continuously():
    clock = Clock()
    rl = MemoryRateLimiter(clock)
    b = [Bucket("a:req", 60, 1.0)]
    assert all([(await rl.take(b)).allowed for _ in range(60)])
    refused = await rl.take(b)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(1.0)
    clock.t += 0.5
    assert not (await rl.take(b)).allowed
    clock.t += 0.5
    assert (await rl.take(b)).allowed  # one per second comes back


async def test_both_buckets_pay_or_neither_does():
    clock = Clock()
    rl = MemoryRateLimiter(clock)
    req, tok = Bucket("a:req", 10, 1.0), Bucket("a:tok", 100, 80.0)
    assert (await rl.take([req, tok])).allowed
    adm = await rl.take([req, tok])  # tokens short: the request bucket must not be charged either
    assert not adm.allowed and adm.remaining == pytest.approx((9.0, 20.0))
    await rl.adjust(tok, 70.0)  # the first request used 10 tokens, not 80
    assert (await rl.take([req, tok])).allowed


def test_oversized_requests_can_still_pass_on_a_full_bucket():
    (req, tok) = buckets_for(tenant(rate_limits={"requests_per_minute": 5, "tokens_per_minute": 1000}), 50_000)
    assert req.cost == 1 and tok.cost == 1000


async def test_reservations_cannot_overrun_and_settle_to_the_real_cost():
    clock = Clock()
    ledger = MemoryBudgetLedger(clock)
    t = tenant(budget={"usd_per_day": 1.0})
    held = [await ledger.reserve(t, f"r{i}", 0.3, 60) for i in range(4)]
    assert [isinstance(h, Reservation) for h in held] == [True, True, True, False]
    assert isinstance(held[3], Refusal) and held[3].period == "day" and held[3].reserved == pytest.approx(0.9)
    await ledger.settle(held[0], Usage(0.05, 100, 40, 10))  # used far less than reserved
    assert isinstance(await ledger.reserve(t, "r4", 0.3, 60), Reservation)
    u = await ledger.usage("a")
    assert u["day"]["spent_usd"] == pytest.approx(0.05) and u["day"]["reserved_usd"] == pytest.approx(0.9)
    assert u["month"]["requests"] == 1 and u["month"]["cached_tokens"] == 40


async def test_a_dead_instances_reservation_expires():
    clock = Clock()
    ledger = MemoryBudgetLedger(clock)
    t = tenant(budget={"usd_per_day": 1.0})
    assert isinstance(await ledger.reserve(t, "r0", 0.9, 30), Reservation)  # never settled
    assert isinstance(await ledger.reserve(t, "r1", 0.9, 30), Refusal)
    clock.t += 31
    assert isinstance(await ledger.reserve(t, "r1", 0.9, 30), Reservation)
