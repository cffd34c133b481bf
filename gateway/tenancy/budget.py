"""Per-tenant spend caps (USD per UTC day and per calendar month), enforced across every gateway instance.

At dispatch a request reserves its worst-case cost (prompt + max output at the dearest pool it may use); the
reservation is refused if spent + reserved + it would pass a cap, so concurrent requests cannot overrun a budget
together. When usage is known the reservation is released and the real cost (cached tokens priced as cached) is
added to `spent`. A reservation is a lease (`routing.budget_lease_s`) that its instance renews while the request runs
(a stream may last far longer than any request timeout): one whose instance died before settling lapses within the
lease instead of holding the budget for the rest of the period.

The same ledger keeps per-tenant usage (requests, tokens, cost) per day and month for the admin API.

Reservations are keyed by the gateway's own request id (minted per request, never the client's x-request-id), and
settling is idempotent per tenant and id (a marker `<prefix>budget:settled:<tenant>:<rid>` kept `SETTLED_TTL_S`): a
settlement queued while Redis was away, or one whose reply was lost, can be replayed without ever counting twice,
and no client can make two requests share a reservation or a settlement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import redis.asyncio as aioredis

from gateway.policy_schema import Tenant

USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
RESERVATION_LEASE_S = 60.0  # default lease: a hold lapses this long after its instance last renewed it


def periods(now: float) -> dict[str, str]:
    """The UTC day and month `now` falls in. Unix time has 86,400 s to a day, so the day's number says both;
    the last day's names are kept (every reservation and settlement asks, and strftime is a slow call)."""
    day = int(now // 86400)
    if _last_day[0] != day:
        d = datetime.fromtimestamp(now, tz=UTC)
        _last_day[:] = [day, {"day": d.strftime("%Y-%m-%d"), "month": d.strftime("%Y-%m")}]
    return dict(_last_day[1])


_last_day: list[Any] = [None, {}]  # [day number, its periods]


@dataclass(frozen=True)
class Reservation:
    tenant: str
    rid: str
    amount: float
    periods: dict[str, str]  # "day"/"month" -> period id the reservation was made in
    shared: bool = True  # held in Redis (False: in this instance's ledger, made while Redis was away)


@dataclass(frozen=True)
class Refusal:
    period: str  # "day" | "month"
    limit: float
    spent: float
    reserved: float


@dataclass(frozen=True)
class Usage:
    cost: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class BudgetLedger(Protocol):
    async def reserve(self, tenant: Tenant, rid: str, amount: float, ttl_s: float) -> Reservation | Refusal: ...
    async def settle(self, r: Reservation, usage: Usage | None) -> None: ...
    async def usage(self, tenant: str) -> dict[str, dict[str, Any]]: ...
    async def renew(self, held: list[Reservation], ttl_s: float) -> None:
        """Extend the holds of reservations still in flight to now + `ttl_s` (a settled one is not re-held)."""


def budget_caps(tenant: Tenant) -> dict[str, float]:
    b = tenant.budget
    return {k: v for k, v in (("day", b.usd_per_day), ("month", b.usd_per_month)) if v is not None}


@dataclass
class _Period:
    spent: float = 0.0
    holds: dict[str, tuple[float, float]] = field(default_factory=dict)  # rid -> (amount, deadline)
    counts: dict[str, float] = field(default_factory=lambda: {f: 0.0 for f in USAGE_FIELDS})

    def reserved(self, now: float) -> float:
        for rid in [r for r, (_, dl) in self.holds.items() if dl <= now]:
            del self.holds[rid]
        return sum(a for a, _ in self.holds.values())


class MemoryBudgetLedger:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._p: dict[tuple[str, str], _Period] = {}

    def _period(self, tenant: str, pid: str) -> _Period:
        return self._p.setdefault((tenant, pid), _Period())

    async def reserve(self, tenant: Tenant, rid: str, amount: float, ttl_s: float,
                      caps: dict[str, float] | None = None) -> Reservation | Refusal:
        """`caps` replaces the tenant's (the fallback passes this instance's share while Redis is away)."""
        now = self.clock()
        ps = periods(now)
        caps = budget_caps(tenant) if caps is None else caps
        for kind, cap in caps.items():
            p = self._period(tenant.name, ps[kind])
            reserved = p.reserved(now)
            if p.spent + reserved + amount > cap:
                return Refusal(kind, cap, p.spent, reserved)
        for kind in caps:
            self._period(tenant.name, ps[kind]).holds[rid] = (amount, now + ttl_s)
        return Reservation(tenant.name, rid, amount, ps, shared=False)

    async def renew(self, held: list[Reservation], ttl_s: float) -> None:
        deadline = self.clock() + ttl_s
        for r in held:
            for pid in set(r.periods.values()):
                p = self._p.get((r.tenant, pid))
                if p is not None and r.rid in p.holds:
                    p.holds[r.rid] = (p.holds[r.rid][0], deadline)

    async def settle(self, r: Reservation, usage: Usage | None) -> None:
        for pid in set(r.periods.values()):
            p = self._period(r.tenant, pid)
            p.holds.pop(r.rid, None)
            if usage is not None:
                p.spent += usage.cost
                for f, v in zip(USAGE_FIELDS, (1, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)):
                    p.counts[f] += v

    async def usage(self, tenant: str) -> dict[str, dict[str, Any]]:
        now = self.clock()
        out = {}
        for kind, pid in periods(now).items():
            p = self._p.get((tenant, pid), _Period())
            out[kind] = {"period": pid, "spent_usd": p.spent, "reserved_usd": p.reserved(now), **p.counts}
        return out

    def spent_and_reserved(self, tenant: str, pid: str) -> float:
        p = self._p.get((tenant, pid))
        return p.spent + p.reserved(self.clock()) if p else 0.0


# KEYS: per capped period: the period hash, its holds zset (rid -> deadline ms), its amounts hash (rid -> usd).
# ARGV: n, rid, amount, now_ms, deadline_ms, ttl_s, then a cap per period. Returns {1, spent + reserved per period}
# or {0, i, spent, reserved}. Idempotent per rid: a retried reservation that already holds is not held twice.
RESERVE_LUA = """
local n, rid, amount, now, deadline, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local held = redis.call('HEXISTS', KEYS[3], rid) == 1  -- a retry of a reservation that did reach Redis
for i = 1, n do
  if held then break end
  local h, z, a = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, x in ipairs(expired) do
    local amt = tonumber(redis.call('HGET', a, x) or '0')
    redis.call('HINCRBYFLOAT', h, 'reserved', -amt)
    redis.call('HDEL', a, x)
    redis.call('ZREM', z, x)
  end
  local spent = tonumber(redis.call('HGET', h, 'spent') or '0')
  local reserved = tonumber(redis.call('HGET', h, 'reserved') or '0')
  if spent + reserved + amount > tonumber(ARGV[6 + i]) then
    return {0, i, tostring(spent), tostring(reserved)}
  end
end
local out = {1}
for i = 1, n do
  local h, z, a = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if not held then
    redis.call('HINCRBYFLOAT', h, 'reserved', amount)
    redis.call('ZADD', z, deadline, rid)
    redis.call('HSET', a, rid, amount)
    for _, k in ipairs({h, z, a}) do redis.call('EXPIRE', k, ttl) end
  end
  local reserved = tonumber(redis.call('HGET', h, 'reserved') or '0')
  table.insert(out, tostring(tonumber(redis.call('HGET', h, 'spent') or '0') + reserved))
end
return out
"""

# KEYS: per period: hash, holds zset, amounts hash; last: the request's settled marker. ARGV: n, rid, cost (or '' =
# failed: release only), prompt, cached, completion, ttl_s, marker ttl_s. Returns 0 if already settled (a replay).
SETTLE_LUA = """
local n, rid, cost, ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[7])
if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', tonumber(ARGV[8])) then return 0 end
for i = 1, n do
  local h, z, a = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local amt = redis.call('HGET', a, rid)
  if amt then
    redis.call('HINCRBYFLOAT', h, 'reserved', -tonumber(amt))
    redis.call('HDEL', a, rid)
    redis.call('ZREM', z, rid)
  end
  if cost ~= '' then
    redis.call('HINCRBYFLOAT', h, 'spent', tonumber(cost))
    redis.call('HINCRBY', h, 'requests', 1)
    redis.call('HINCRBY', h, 'prompt_tokens', tonumber(ARGV[4]))
    redis.call('HINCRBY', h, 'cached_tokens', tonumber(ARGV[5]))
    redis.call('HINCRBY', h, 'completion_tokens', tonumber(ARGV[6]))
    redis.call('EXPIRE', h, ttl)
  end
end
return 1
"""

PERIOD_TTL_S = {"day": 3 * 86400, "month": 40 * 86400}
# how long a settlement stays recognisable as done: longer than a replay waits (an outage), short enough that a busy
# fleet's markers (one small key per request) stay a small part of Redis's memory
SETTLED_TTL_S = 3600


class RedisBudgetLedger:
    def __init__(self, client: aioredis.Redis, prefix: str = "gw:", clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.p = f"{prefix}budget:"
        self.clock = clock
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self.seen: dict[tuple[str, str], float] = {}  # (tenant, period id) -> spent + reserved, as last answered

    def _keys(self, tenant: str, pid: str) -> list[str]:
        base = f"{self.p}{tenant}:{pid}"
        return [base, base + ":holds", base + ":amounts"]

    async def reserve(self, tenant: Tenant, rid: str, amount: float, ttl_s: float) -> Reservation | Refusal:
        now = self.clock()
        ps = periods(now)
        caps = budget_caps(tenant)
        kinds = list(caps)
        keys = [k for kind in kinds for k in self._keys(tenant.name, ps[kind])]
        if kinds:
            out = await self._reserve(keys=keys, args=[len(kinds), rid, repr(amount), int(now * 1000),
                                                       int((now + ttl_s) * 1000), PERIOD_TTL_S["month"],
                                                       *[repr(caps[k]) for k in kinds]])
            if int(out[0]) == 0:
                kind = kinds[int(out[1]) - 1]
                self.seen[(tenant.name, ps[kind])] = float(out[2]) + float(out[3])
                return Refusal(kind, caps[kind], float(out[2]), float(out[3]))
            if len(self.seen) > 100_000:
                self.seen.clear()
            for kind, used in zip(kinds, out[1:]):
                self.seen[(tenant.name, ps[kind])] = float(used)
        return Reservation(tenant.name, rid, amount, ps)

    async def renew(self, held: list[Reservation], ttl_s: float) -> None:
        """One round trip: each hold still present gets the new deadline (ZADD XX never re-creates a settled one)."""
        if not held:
            return
        deadline = int((self.clock() + ttl_s) * 1000)
        pipe = self.r.pipeline(transaction=False)
        for r in held:
            for pid in set(r.periods.values()):
                pipe.zadd(self._keys(r.tenant, pid)[1], {r.rid: deadline}, xx=True)
        await pipe.execute()

    def _settle_call(self, r: Reservation, usage: Usage | None) -> tuple[list[str], list[str | int]]:
        kinds = list(r.periods)
        keys = [k for kind in kinds for k in self._keys(r.tenant, r.periods[kind])] + [f"{self.p}settled:{r.tenant}:{r.rid}"]
        u = usage or Usage(0.0, 0, 0, 0)
        return keys, [len(kinds), r.rid, repr(u.cost) if usage else "", u.prompt_tokens, u.cached_tokens,
                      u.completion_tokens, PERIOD_TTL_S["month"], SETTLED_TTL_S]

    async def settle(self, r: Reservation, usage: Usage | None) -> None:
        keys, args = self._settle_call(r, usage)
        await self._settle(keys=keys, args=args)

    async def settle_many(self, items: list[tuple[Reservation, Usage | None]]) -> int:
        """Replay settlements in one round trip; returns how many were new (the others had already reached it)."""
        pipe = self.r.pipeline(transaction=False)
        for r, usage in items:
            keys, args = self._settle_call(r, usage)
            await self._settle(keys=keys, args=args, client=pipe)
        return sum(int(x) for x in await pipe.execute())

    async def usage(self, tenant: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        now_ms = int(self.clock() * 1000)
        for kind, pid in periods(self.clock()).items():
            h, z, a = self._keys(tenant, pid)
            raw = await self.r.hgetall(h)
            live = await self.r.zrangebyscore(z, now_ms, "+inf")
            amounts = await self.r.hmget(a, list(live)) if live else []  # type: ignore[arg-type]
            vals = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}
            out[kind] = {"period": pid, "spent_usd": vals.get("spent", 0.0),
                         "reserved_usd": sum(float(x) for x in amounts if x is not None),
                         **{f: vals.get(f, 0.0) for f in USAGE_FIELDS}}
        return out
