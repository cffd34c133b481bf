"""The shared-state client against a real Redis: a pool that runs out of connections makes callers wait and says
"saturated" (never "away"); limits calls retried through saturation land in Redis; every write that may be
retried or replayed — reservation, settlement, rate-limit take — counts once."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import hash_key
from gateway.policy_schema import Tenant
from gateway.shared_redis import PoolSaturated, RedisGuard, build_client
from gateway.tenancy.budget import MemoryBudgetLedger, RedisBudgetLedger, Usage
from gateway.tenancy.fallback import FallbackBudgetLedger
from gateway.tenancy.ratelimit import Bucket, RedisRateLimiter


def tenant() -> Tenant:
    return Tenant.model_validate({"name": "acme", "api_key_hashes": [hash_key("k")], "models": ["m"],
                                  "budget": {"usd_per_day": 1.0}})


async def hold_only_connection(client, seconds: float) -> asyncio.Task:
    """Occupy the pool's single connection with a blocking pop for `seconds`."""
    task = asyncio.create_task(client.blpop([f"nothing:{time.monotonic_ns()}"], timeout=seconds))
    while not client.connection_pool._in_use_connections:  # noqa: ASYNC110 - redis-py's pool has no event to await
        await asyncio.sleep(0.001)
    return task


def test_a_full_pool_is_saturation_and_a_limits_call_waits_it_out(redis_server):
    async def run() -> None:
        client = build_client(redis_server.url, password=None, max_connections=1, pool_timeout=0.05, connect_timeout=1)
        try:
            held = await hold_only_connection(client, 1)
            with pytest.raises(PoolSaturated):
                await client.ping()
            await held

            seen: list[tuple[str, str]] = []
            guard = RedisGuard("budgets", on_fallback=lambda w, r: seen.append((w, r)))
            ledger = FallbackBudgetLedger(RedisBudgetLedger(client, f"p{time.monotonic_ns()}:"), MemoryBudgetLedger(),
                                          guard, timeout=0.3)
            held = await hold_only_connection(client, 1)
            got = await ledger.reserve(tenant(), "r1", 0.25, 60)  # saturated for ~1 s: retried, not abandoned
            await held
            assert got.shared and guard.available and seen == []
            assert (await ledger.usage("acme"))["day"]["reserved_usd"] == pytest.approx(0.25)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_reservations_settlements_and_takes_count_once_however_often_they_are_sent(redis_server):
    async def run() -> None:
        client = build_client(redis_server.url, password=None, max_connections=4, pool_timeout=0.5, connect_timeout=1)
        prefix = f"p{time.monotonic_ns()}:"
        try:
            ledger = RedisBudgetLedger(client, prefix)
            r = await ledger.reserve(tenant(), "req-1", 0.25, 60)
            assert await ledger.reserve(tenant(), "req-1", 0.25, 60) == r  # a retry that had reached Redis
            assert (await ledger.usage("acme"))["day"]["reserved_usd"] == pytest.approx(0.25)
            used = Usage(0.1, 100, 0, 10)
            await ledger.settle(r, used)
            await ledger.settle(r, used)  # its reply was lost: sent again
            assert await ledger.settle_many([(r, used), (r, used)]) == 0  # replayed from a queue: nothing new
            day = (await ledger.usage("acme"))["day"]
            assert day["spent_usd"] == pytest.approx(0.1) and day["requests"] == 1
            assert day["reserved_usd"] == pytest.approx(0.0)

            limiter = RedisRateLimiter(client, prefix)
            b = Bucket("acme:req", 10, 1.0)
            first = await limiter.take([b], attempt="a1")
            again = await limiter.take([b], attempt="a1")
            assert again == first and first.remaining[0] == pytest.approx(9, abs=0.01)
            assert (await limiter.take([b], attempt="a2")).remaining[0] == pytest.approx(8, abs=0.01)
        finally:
            await client.aclose()

    asyncio.run(run())
