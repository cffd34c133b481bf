"""The shared-state client against a real Redis: a pool that runs out of connections makes callers wait and says
"saturated" (never "away"); limits calls retried through saturation land in Redis; every write that may be
retried or replayed — reservation, settlement, rate-limit take — counts once; a Redis restart costs no outage
(pooled connections to the old process are replaced on the call that finds them dead), a Redis gone still does."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gateway.config import hash_key
from gateway.policy_schema import Tenant
from gateway.shared_redis import PoolSaturated, RedisGuard, build_client
from gateway.tenancy.budget import MemoryBudgetLedger, RedisBudgetLedger, Usage
from gateway.tenancy.fallback import FallbackBudgetLedger
from gateway.tenancy.ratelimit import Bucket, RedisRateLimiter
from tests.support import RedisServer


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


async def warm_pool(client, n: int) -> None:
    """Leave `n` connections open in the pool (n blocking pops at once, each on its own connection)."""
    await asyncio.gather(*(client.blpop([f"nothing:{time.monotonic_ns()}:{i}"], timeout=0.05) for i in range(n)))
    assert len(client.connection_pool._available_connections) == n


def budgets(client) -> tuple[FallbackBudgetLedger, RedisGuard, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    guard = RedisGuard("budgets", on_fallback=lambda w, r: seen.append((w, r)))
    ledger = FallbackBudgetLedger(RedisBudgetLedger(client, f"p{time.monotonic_ns()}:"), MemoryBudgetLedger(), guard,
                                  timeout=1.0)
    return ledger, guard, seen


def test_a_redis_restart_is_not_an_outage(caplog):
    """Every pooled connection still points at the old process after a restart; the first call on one must reconnect
    and succeed, not report "Redis is away" (the chaos run's one "fall back" line per instance after redis_down)."""
    server = RedisServer()

    async def run() -> None:
        client = build_client(server.url, password=None, max_connections=4, pool_timeout=0.5, connect_timeout=1)
        try:
            ledger, guard, seen = budgets(client)
            await warm_pool(client, 3)
            server.kill()
            server.start()  # same port, a new process
            caplog.set_level(logging.WARNING, logger="gateway.shared_state")
            got = await ledger.reserve(tenant(), "after-restart", 0.01, 60)
            assert got.shared and guard.available and guard.down_reason is None and seen == []
            # the other two stale connections, each taken by a call at once
            more = await asyncio.gather(*(ledger.reserve(tenant(), f"r{i}", 0.01, 60) for i in range(3)))
            assert all(r.shared for r in more) and guard.available and seen == []
            assert (await ledger.usage("acme"))["day"]["reserved_usd"] == pytest.approx(0.04)
            assert [r.getMessage() for r in caplog.records] == []
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        server.stop()


def test_a_redis_killed_and_not_restarted_is_away_on_the_first_call(caplog):
    """The reconnect after a dead pooled connection is refused: that very call finds Redis away (not a slow call
    that needs `hung_after` to judge), logs once and is served locally."""
    server = RedisServer()

    async def run() -> None:
        client = build_client(server.url, password=None, max_connections=4, pool_timeout=0.5, connect_timeout=1)
        try:
            ledger, guard, seen = budgets(client)
            await warm_pool(client, 2)
            server.kill(hard=True)
            caplog.set_level(logging.WARNING, logger="gateway.events")
            got = await ledger.reserve(tenant(), "after-kill", 0.01, 60)
            assert not got.shared and not guard.available and guard.down_reason == "unavailable"
            assert seen == [("budgets", "unavailable")]
            assert [(r.fields["event"], r.fields["what"], r.fields["reason"]) for r in caplog.records
                    if hasattr(r, "fields")] == [("redis_away", "budgets", "unavailable")]
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        server.stop()
