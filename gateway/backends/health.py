"""Active health checks: every interval, probe each target (SGLang `/health`, hosted `/models`) concurrently.

Two consecutive failures mark a target unhealthy; one success marks it healthy again. litellm targets have no
probe (their provider is assumed up; the passive breaker still guards them).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.config import HealthChecks
from gateway.observability.metrics import GatewayMetrics
from gateway.upstreams import Target, UpstreamRegistry
from gateway.background import BackgroundTask

log = logging.getLogger("gateway.health")
UNHEALTHY_AFTER = 2


class HealthChecker:
    def __init__(self, registry: UpstreamRegistry, client: httpx.AsyncClient, cfg: HealthChecks, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.client = client
        self.cfg = cfg
        self.metrics = metrics
        self._bg = BackgroundTask(self._run, "health-checks")

    def start(self) -> None:
        if self.cfg.enabled:
            self._bg.start()

    async def stop(self) -> None:
        await self._bg.stop()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(t) for t in self.registry.targets if t.kind != "litellm"))

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval_s)

    async def _check(self, t: Target) -> None:
        headers = {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}
        try:
            r = await self.client.get(t.health_url(), headers=headers, timeout=self.cfg.timeout_s)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            t.health_failures = 0
            t.healthy = True
        else:
            t.health_failures += 1
            if t.health_failures >= UNHEALTHY_AFTER and t.healthy:
                log.warning("replica %s of pool %s marked unhealthy", t.name, t.pool)
                t.healthy = False
        self.metrics.replica_healthy.labels(t.pool, t.name).set(1 if t.healthy else 0)
        self.metrics.breaker_open.labels(t.pool, t.name).set(0 if t.breaker.available() else 1)
