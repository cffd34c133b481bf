"""Active health checks: every interval, probe each server (SGLang `/ping`, hosted `/models`) concurrently.

Liveness, not readiness for work: SGLang's `/health` runs a one-token generation and waits for scheduler output
(up to 20 s), so behind a long chunked prefill it is slow on a busy, healthy server. The default probe is `/ping`
(a flag check on every release); a pool that still probes `/health` has a failed or slow answer re-checked on
`/ping`, and a server that answers there is busy, not dead. A server that answers `/ping` but not requests is the
dispatcher's case (first-byte timeouts and the circuit breaker), which this never resets.

Two consecutive failures mark a target unhealthy; one success marks it healthy again. A server split into DP-rank
targets is probed once and the answer applies to every rank. litellm targets have no probe (their provider is
assumed up; the passive breaker still guards them).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.background import BackgroundTask
from gateway.config import HealthChecks
from gateway.observability.metrics import GatewayMetrics
from gateway.upstreams import Target, UpstreamRegistry

log = logging.getLogger("gateway.health")
UNHEALTHY_AFTER = 2
BUSY_NOT_DEAD = "/ping"  # SGLang's cheap liveness check (every release)


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
        groups: dict[tuple[str, str], list[Target]] = {}
        for t in self.registry.targets:
            if t.caps.health_probe:
                groups.setdefault((t.pool, t.server), []).append(t)
        await asyncio.gather(*(self._check(ts) for ts in groups.values()))

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval_s)

    async def _probe(self, t: Target, path: str) -> bool:
        headers = {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}
        try:
            r = await self.client.get(f"{t.base_url}{path}", headers=headers, timeout=self.cfg.timeout_s)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _check(self, targets: list[Target]) -> None:
        t = targets[0]
        ok = await self._probe(t, t.health_path)
        if not ok and t.caps.engine_loads and t.health_path != BUSY_NOT_DEAD:
            ok = await self._probe(t, BUSY_NOT_DEAD)  # a slow /health behind a long prefill: busy, not dead
        for x in targets:
            s = x.state
            if ok:
                s.health_failures = 0
                s.healthy = True
            else:
                s.health_failures += 1
                if s.health_failures >= UNHEALTHY_AFTER and s.healthy:
                    log.warning("replica %s of pool %s marked unhealthy", x.name, x.pool)
                    s.healthy = False
            self.metrics.replica_healthy.labels(x.pool, x.name).set(1 if x.healthy else 0)
            self.metrics.breaker_open.labels(x.pool, x.name).set(0 if x.breaker.available() else 1)

    def unreachable(self, t: Target) -> None:
        """The dispatcher could not connect: unhealthy at once (no request waits on it again) until a probe answers."""
        if t.state.healthy:
            log.warning("replica %s of pool %s refused a connection: marked unhealthy until a probe answers", t.name,
                        t.pool)
        t.state.healthy = False
        self.metrics.replica_healthy.labels(t.pool, t.name).set(0)
