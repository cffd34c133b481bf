"""Rate limits and budgets shared through Redis, with a local fallback that never loses spend.

A call goes to Redis, each attempt bounded by `timeout`. A slow attempt (a saturated connection pool, a late reply)
is retried: a busy instance is not an outage (`gateway/shared_redis.py` tells them apart). Only when Redis is away
(refused, reset, loading, or no answer to anyone for `hung_after` — see `RedisGuard`) is the call served by this
instance's in-memory state, counted in `gateway_shared_state_fallbacks_total{what,reason}` and logged; Redis is
tried again a second later. Retries are idempotent: a reservation is keyed by request id, a rate-limit take by an
attempt id, so an attempt whose reply was lost is never counted twice.

Local state is conservative: while Redis is away an instance may use only its **share** — the budget remaining
when Redis last answered (or the cap, if it never did) times `share()`, by default 1 / the instances alive then;
a rate limit's per-minute allowance likewise. So a fleet of N instances together stays near the cap, not N times it.

Reservations live as long as their request: each is a lease (`routing.budget_lease_s`) that this instance renews,
every third of it, until the request is settled — a stream of an hour keeps its hold for the hour, and the holds of
an instance that died lapse within the lease.

Spend is never lost: a settlement that cannot reach Redis is queued and replayed when Redis answers (a background
loop, every `retry_after`), idempotently (settling is keyed by request id: a replay never counts twice). Usage
served by this instance is then Redis's figures plus what is still queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.background import BackgroundTask
from gateway.config import Routing
from gateway.policy_schema import Tenant
from gateway.shared_redis import REDIS_ERRORS, RedisGuard
from gateway.tenancy.budget import (
    RESERVATION_LEASE_S,
    USAGE_FIELDS,
    MemoryBudgetLedger,
    RedisBudgetLedger,
    Refusal,
    Reservation,
    Usage,
    budget_caps,
    periods,
)
from gateway.tenancy.ratelimit import (
    Admission,
    Bucket,
    MemoryRateLimiter,
    RedisRateLimiter,
)

log = logging.getLogger("gateway.shared_state")
T = TypeVar("T")
_LOCAL = object()  # `_try`'s answer when the call must be served locally


class FleetShare:
    """The share of a limit one instance may use on its own: `fixed`, or 1 / the gateway instances alive when Redis
    last answered (the load tracker's heartbeats in `<prefix>gateways`, refreshed by the budget replay loop)."""

    def __init__(self, client: Any = None, prefix: str = "gw:", fixed: float | None = None, dead_after: float = 3.0) -> None:
        self.r, self.key, self.fixed, self.dead_after = client, f"{prefix}gateways", fixed, dead_after
        self.instances = 1

    def __call__(self) -> float:
        return self.fixed if self.fixed is not None else 1.0 / max(1, self.instances)

    async def refresh(self) -> None:
        if self.r is not None and self.fixed is None:
            self.instances = max(1, int(await self.r.zcount(self.key, time.time() - self.dead_after, "+inf")))


class _Fallback:
    def __init__(self, shared: Any, local: Any, guard: RedisGuard, timeout: float,
                 share: FleetShare | None = None) -> None:
        self.shared, self.local, self.guard, self.timeout = shared, local, guard, timeout
        self.share = share or FleetShare(fixed=1.0)

    async def _try(self, call: Callable[[Any], Awaitable[T]], retry_slow: bool = True) -> Any:
        """`call(shared)`'s result, or `_LOCAL` (counted) when Redis is away. A slow call (a timeout, a saturated
        pool) is retried while Redis is not judged away (`RedisGuard`: no success at all for `hung_after`), each
        attempt bounded by `timeout`; with `retry_slow=False` it is answered locally at once instead."""
        if self.shared is None:
            return _LOCAL
        if not self.guard.available:
            self.guard.fallback("away")
            return _LOCAL
        while True:
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout):
                    out = await call(self.shared)
                self.guard.succeeded()
                return out
            except REDIS_ERRORS as e:
                reason = self.guard.failed(e, start)
                if reason in ("timeout", "saturated") and retry_slow and self.guard.available:
                    await asyncio.sleep(0.01)
                    continue
                self.guard.fallback(reason)
                return _LOCAL


def _local_bucket(b: Bucket, share: float) -> Bucket:
    limit = max(1, int(b.limit * share))
    return Bucket(b.key, limit, min(b.cost, float(limit)))


class FallbackRateLimiter(_Fallback):
    async def take(self, buckets: list[Bucket]) -> Admission:
        attempt = uuid.uuid4().hex  # one id for every retry of this admission: it is taken once
        out = await self._try(lambda impl: impl.take(buckets, attempt))
        if out is not _LOCAL:
            return out  # type: ignore[no-any-return]
        return await self.local.take([_local_bucket(b, self.share()) for b in buckets])  # type: ignore[no-any-return]

    async def adjust(self, bucket: Bucket, delta: float) -> None:
        # a token-bucket correction is soft state (it refills within a minute): not queued, applied where it can be
        if await self._try(lambda impl: impl.adjust(bucket, delta), retry_slow=False) is _LOCAL:
            await self.local.adjust(_local_bucket(bucket, self.share()), delta)


class FallbackBudgetLedger(_Fallback):
    shared: RedisBudgetLedger | None
    local: MemoryBudgetLedger

    def __init__(self, shared: RedisBudgetLedger | None, local: MemoryBudgetLedger, guard: RedisGuard, timeout: float,
                 share: FleetShare | None = None, retry_after: float = 1.0, replay_batch: int = 200,
                 lease_s: float = RESERVATION_LEASE_S) -> None:
        super().__init__(shared, local, guard, timeout, share)
        self.retry_after, self.replay_batch = retry_after, replay_batch
        self.pending: deque[tuple[Reservation, Usage | None]] = deque()  # settlements Redis has not acknowledged
        self._anchor: dict[tuple[str, str], float] = {}  # (tenant, period) -> this instance's cap in this outage
        self._replayer = BackgroundTask(self._replay_loop, "budget-replay")
        self.replayed = 0
        self.lease_s = lease_s
        self.live: dict[tuple[str, str], Reservation] = {}  # (tenant, rid) -> a reservation not settled yet
        self._leases = BackgroundTask(self._lease_loop, "budget-leases")

    # -- the ledger ------------------------------------------------------------------------------------------
    async def reserve(self, tenant: Tenant, rid: str, amount: float, ttl_s: float) -> Reservation | Refusal:
        """`ttl_s`: the hold's first lease; it is renewed for `lease_s` every third of `lease_s` until settled."""
        out = await self._try(lambda impl: impl.reserve(tenant, rid, amount, ttl_s))
        if out is not _LOCAL:
            self._anchor.clear()  # Redis answers: the next outage takes a fresh share
        else:
            out = await self.local.reserve(tenant, rid, amount, ttl_s, caps=self._local_caps(tenant))
        if isinstance(out, Reservation):
            self.live[(out.tenant, out.rid)] = out
        return out  # type: ignore[no-any-return]

    async def renew(self, held: list[Reservation], ttl_s: float) -> None:
        shared = [r for r in held if r.shared]
        if shared:
            await self._try(lambda impl: impl.renew(shared, ttl_s), retry_slow=False)
        await self.local.renew([r for r in held if not r.shared], ttl_s)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if self.live:
                await self.renew(list(self.live.values()), self.lease_s)

    def _local_caps(self, tenant: Tenant) -> dict[str, float]:
        """This instance's caps while Redis is away: what it already holds locally plus its share of what remained
        when Redis last answered (the whole cap's share if it never did), fixed for the outage."""
        ps = periods(self.local.clock())
        caps = {}
        for kind, cap in budget_caps(tenant).items():
            key = (tenant.name, ps[kind])
            if key not in self._anchor:
                seen = self.shared.seen.get(key, 0.0) if self.shared is not None else 0.0
                self._anchor[key] = self.local.spent_and_reserved(*key) + max(0.0, cap - seen) * self.share()
            caps[kind] = self._anchor[key] if self.shared is not None else cap
        return caps

    async def settle(self, r: Reservation, usage: Usage | None) -> None:
        self.live.pop((r.tenant, r.rid), None)  # no longer renewed, whatever happens to the settlement
        if not r.shared:
            await self.local.settle(r, None)  # release the local hold; the spend goes to the shared ledger
            if usage is None:
                return  # nothing held in Redis, nothing spent
        if self.shared is None:
            await self.local.settle(r, usage)
            return
        if await self._try(lambda impl: impl.settle(r, usage), retry_slow=False) is _LOCAL:  # queued: replayed within a second
            self.pending.append((r, usage))
            if usage is not None:  # also this instance's own: counted against its share for the rest of the outage
                await self.local.settle(r, usage)

    async def usage(self, tenant: str) -> dict[str, dict[str, Any]]:
        """Redis's figures plus this instance's settlements still queued; this instance's own while Redis is away."""
        out = await self._try(lambda impl: impl.usage(tenant))
        if out is _LOCAL:
            out = await self.local.usage(tenant)
            if self.shared is not None:  # Redis is away: say these are this instance's figures only
                for day in out.values():
                    day["shared"] = False
            return out
        for kind, row in out.items():
            queued = [(r, u) for r, u in self.pending if r.tenant == tenant and r.periods.get(kind) == row["period"]]
            for _, u in queued:
                if u is not None:
                    row["spent_usd"] += u.cost
                    for f, v in zip(USAGE_FIELDS, (1, u.prompt_tokens, u.cached_tokens, u.completion_tokens)):
                        row[f] += v
            row["pending_settlements"] = len(queued)
        return out  # type: ignore[no-any-return]

    # -- replay ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._leases.start()
        if self.shared is not None:
            self._replayer.start()

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop the loops and make a last attempt to deliver what is queued; what still cannot be is logged."""
        await self._leases.stop()
        await self._replayer.stop()
        try:
            async with asyncio.timeout(flush_timeout):
                await self.replay()
        except REDIS_ERRORS:
            pass
        if self.pending:
            lost = sum(u.cost for _, u in self.pending if u is not None)
            log.error("budget settlements never reached Redis: %d requests, $%.6f", len(self.pending), lost)

    async def replay(self) -> int:
        """Deliver the queue oldest first, a batch per round trip; an entry leaves only once Redis has it."""
        if self.shared is None:
            return 0
        done = 0
        while self.pending:
            batch = [self.pending[i] for i in range(min(self.replay_batch, len(self.pending)))]
            async with asyncio.timeout(self.timeout * 5):
                await self.shared.settle_many(batch)
            for _ in batch:
                self.pending.popleft()
            done += len(batch)
        if done:
            self.replayed += done
            log.warning("redis answers again: %d budget settlements replayed", done)
        return done

    async def _replay_loop(self) -> None:
        while True:
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout):
                    await self.share.refresh()
                if self.pending:
                    await self.replay()
                self.guard.succeeded()
            except REDIS_ERRORS as e:
                self.guard.failed(e, start)
            await asyncio.sleep(self.retry_after)


def build_limits(client: Any, rc: Routing, on_fallback: Callable[[str, str], None] | None = None
                 ) -> tuple[FallbackRateLimiter, FallbackBudgetLedger]:
    """The app's rate limiter and budget ledger: Redis-backed when `client` is given, in memory otherwise."""
    share = FleetShare(client, rc.redis_prefix, rc.limits_fallback_share) if client is not None else None
    limiter = FallbackRateLimiter(client and RedisRateLimiter(client, rc.redis_prefix), MemoryRateLimiter(),
                                  RedisGuard("rate limits", on_fallback=on_fallback, hung_after=rc.redis_hung_after_s), rc.limits_redis_timeout_s, share)
    budget = FallbackBudgetLedger(client and RedisBudgetLedger(client, rc.redis_prefix), MemoryBudgetLedger(),
                                  RedisGuard("budgets", on_fallback=on_fallback, hung_after=rc.redis_hung_after_s), rc.limits_redis_timeout_s, share,
                                  lease_s=rc.budget_lease_s)
    return limiter, budget
