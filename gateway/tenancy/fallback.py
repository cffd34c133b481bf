"""Shared state with a local fallback: the Redis implementation while Redis answers within its timeout, the
in-memory one otherwise (for `retry_after` seconds before Redis is tried again). No request fails because Redis
is away; limits and budgets then hold per instance until it returns."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from gateway.tenancy.budget import Refusal, Reservation, Usage
from gateway.tenancy.policy_schema import Tenant
from gateway.tenancy.ratelimit import Admission, Bucket

log = logging.getLogger("gateway.shared_state")
T = TypeVar("T")


class _Fallback:
    def __init__(self, shared: Any, local: Any, timeout: float, retry_after: float, what: str) -> None:
        self.shared, self.local = shared, local
        self.timeout, self.retry_after, self.what = timeout, retry_after, what
        self._down_until = 0.0

    async def _run(self, call: Callable[[Any], Awaitable[T]]) -> T:
        if self.shared is not None and time.monotonic() >= self._down_until:
            try:
                async with asyncio.timeout(self.timeout):
                    return await call(self.shared)
            except (RedisError, OSError, TimeoutError) as e:
                if self._down_until <= time.monotonic():
                    log.warning("redis unavailable (%s): %s fall back to this instance", type(e).__name__, self.what)
                self._down_until = time.monotonic() + self.retry_after
        return await call(self.local)


class FallbackRateLimiter(_Fallback):
    async def take(self, buckets: list[Bucket]) -> Admission:
        return await self._run(lambda impl: impl.take(buckets))

    async def adjust(self, bucket: Bucket, delta: float) -> None:
        await self._run(lambda impl: impl.adjust(bucket, delta))


class FallbackBudgetLedger(_Fallback):
    async def reserve(self, tenant: Tenant, rid: str, amount: float, ttl_s: float) -> Reservation | Refusal:
        return await self._run(lambda impl: impl.reserve(tenant, rid, amount, ttl_s))

    async def settle(self, r: Reservation, usage: Usage | None) -> None:
        await self._run(lambda impl: impl.settle(r, usage))

    async def usage(self, tenant: str) -> dict[str, dict[str, float]]:
        return await self._run(lambda impl: impl.usage(tenant))

