"""The shared-state client against a real Redis: a pool that runs out of connections makes callers wait and says
"saturated" (never "away"); limits calls retried through saturation land in Redis; every write that may be
retried or replayed — reservation, settlement, rate-limit take — counts once; a Redis restart costs no outage
(pooled connections to the old process are replaced on the call that finds them dead), a Redis gone still does; a
Redis that hangs (connected, never answering) costs each call its own bound, since the client has no socket timeout."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from gateway.api.responses.store import RedisResponseStore
from gateway.config import ResponsesConfig, hash_key
from gateway.control.store import RedisControlStore, StoreUnavailable
from gateway.dispatch.quarantine import BodyPrint, Quarantine
from gateway.errors import NoCapacity
from gateway.flow.controller import FairTags
from gateway.flow.shared import RedisFairTags
from gateway.pipeline import idempotency
from gateway.policy_schema import Tenant
from gateway.prefix.redis import RedisPrefixIndex
from gateway.routing.load import RedisLoadTracker
from gateway.shared_redis import PoolSaturated, RedisGuard, build_client
from gateway.tenancy.budget import MemoryBudgetLedger, RedisBudgetLedger, Usage
from gateway.tenancy.concurrency import ConcurrencyLimiter
from gateway.tenancy.fallback import FallbackBudgetLedger, FallbackRateLimiter
from gateway.tenancy.idempotency import RedisIdempotencyStore
from gateway.tenancy.ratelimit import Bucket, MemoryRateLimiter, RedisRateLimiter
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


HUNG_DEADLINE_S = 30.0  # fails the test only when a call truly waits on the hung Redis (each call's bound is <= 1 s)


def test_a_hung_redis_costs_each_call_its_own_bound_and_every_user_answers_as_it_does_when_redis_is_away():
    """SIGSTOP: Redis keeps its connections (and accepts new ones) but never answers. The client has no socket
    timeout of its own, so each call site's bound is all that stands between a caller and waiting for good: every
    user of the client answers — from its local state, with its refusal, or by skipping the write — and the control
    channel's listener is cancellable. After SIGCONT the same calls reach Redis again."""
    server = RedisServer()
    p = f"h{time.monotonic_ns()}:"

    async def within(aw):
        return await asyncio.wait_for(aw, HUNG_DEADLINE_S)

    async def run() -> None:
        client = build_client(server.url, password=None, max_connections=8, pool_timeout=0.05, connect_timeout=1)
        assert client.connection_pool.connection_kwargs["socket_timeout"] is None

        def guard(what: str) -> RedisGuard:
            return RedisGuard(what, retry_after=0.2, hung_after=0.5)

        index = RedisPrefixIndex(client, prefix=p, timeout=0.1, guard=guard("prefix index"))
        loads = RedisLoadTracker(client, prefix=p, timeout=0.1, guard=guard("load"))
        limiter = FallbackRateLimiter(RedisRateLimiter(client, p), MemoryRateLimiter(), guard("rate limits"), 0.3)
        ledger = FallbackBudgetLedger(RedisBudgetLedger(client, p), MemoryBudgetLedger(), guard("budgets"), 0.3)
        caps = ConcurrencyLimiter(client, p, 30.0, 0.3, guard("concurrency caps"))
        idem = RedisIdempotencyStore(client, p, 60)
        control = RedisControlStore(client, p, timeout=0.3)
        quarantine = Quarantine(60, client, p, timeout=0.1, sync_s=0.0)
        flow = RedisFairTags(client, p, 0.1, guard("flow"))
        responses = RedisResponseStore(client, ResponsesConfig(), p, 0.3)
        tags = FairTags()
        body = BodyPrint({"model": "m", "messages": [{"role": "user", "content": "x"}]})
        bucket = Bucket("acme:req", 600, 1.0)
        try:
            await index.insert("r1", [1, 2, 3], 60)  # what each user reads once Redis answers again
            assert await index.match([1, 2, 3], ["r1"]) == {"r1": 3}
            await warm_pool(client, 4)
            channel = control.events()
            assert await within(anext(channel)) == {"kind": "resync"}  # subscribed while Redis answered
            waiting = asyncio.create_task(anext(channel))  # the listener's wait: no end of its own, by design

            os.kill(server.proc.pid, signal.SIGSTOP)  # our own redis-server, by its PID
            try:
                assert await within(index.match([1, 2, 3], ["r1"])) == {"r1": 3}  # the local mirror
                await within(index.insert("r1", [4], 60))  # queued for replay
                assert await within(index.size()) == 4  # the admin's figure: this instance's own count
                assert (await within(loads.snapshot(["r1"])))["r1"].inflight == 0
                loads.apply("r1", 100.0, 1.0)
                await within(loads.settle())  # the write-behind exchange gives up within its bound
                assert (await within(limiter.take([bucket]))).allowed  # this instance's share of the limit
                held = await within(ledger.reserve(tenant(), "hung-1", 0.01, 60))
                assert not held.shared  # this instance's ledger
                await within(ledger.settle(held, Usage(0.01, 10, 0, 2)))
                assert ledger.pending  # queued for the replay
                assert (await within(ledger.usage("acme")))["day"]["shared"] is False
                slot = caps.try_take("acme", "req-1", 5)
                assert slot is not None and await within(caps.take_fleet(slot, 5))  # the local cap alone
                with pytest.raises(NoCapacity):  # a key is refused rather than risk serving it twice
                    await within(idempotency.begin(idem, 1024, "key-1", "acme", "/v1/chat/completions", {"a": 1}))
                await within(idempotency.end(idem, idempotency.Held("key-1", "fp", 1024), "acme", "req-1", True,
                                             False, {}))
                with pytest.raises(StoreUnavailable):
                    await within(control.load())
                with pytest.raises(StoreUnavailable):
                    await within(control.publish({"kind": "changed"}))
                quarantine.add_soon(body)
                assert await within(quarantine.blocked(body))  # the local mirror
                await within(quarantine.drain())
                await within(flow.charge(tags, 0, "acme", 1.0))
                assert await within(flow.scan(tags, 1)) == {}
                await within(flow.refresh(tags, [(0, "acme")]))
                with pytest.raises(NoCapacity):
                    await within(responses.get("acme", "resp_1"))
                assert await within(responses.put("acme", "resp_1", b'{"response": {}}')) is False
                assert not waiting.done()  # still listening, and cancellable
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await within(waiting)
                await within(ledger.stop(flush_timeout=0.5))  # the shutdown's last replay gives up in time
                await within(caps.stop())
                await within(loads.stop())
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)

            await asyncio.sleep(0.3)  # past the guards' retry_after: Redis is asked again
            assert await within(ledger.replay()) == 1  # the queued settlement reaches Redis
            assert (await within(ledger.reserve(tenant(), "back-1", 0.01, 60))).shared
            assert (await within(ledger.usage("acme")))["day"]["requests"] == 1
            await within(index.match([9], ["r1"]))  # replays the writes queued meanwhile
            assert await within(index.size()) == 4 and index.available
            assert await within(control.load()) is not None
            assert (await within(limiter.take([bucket]))).allowed and limiter.guard.available
        finally:
            await client.aclose()

    try:
        asyncio.run(run())
    finally:
        server.stop()
