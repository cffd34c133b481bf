"""Active health checks: every interval, probe each server (SGLang `/ping`, hosted `/models`) concurrently.

Liveness, not readiness for work: SGLang's `/health` runs a one-token generation and waits for scheduler output
(up to 20 s), so behind a long chunked prefill it is slow on a busy, healthy server. The default probe is `/ping`
(a flag check on every release); a pool that still probes `/health` has a failed or slow answer re-checked on
`/ping`, and a server that answers there is busy, not dead. A server that answers `/ping` but not requests is the
dispatcher's case (first-byte timeouts and the circuit breaker), which this never resets.

Two consecutive failures mark a target unhealthy; one success marks it healthy again. A probe answered 401/403 is not
a failure: the endpoint is up and refuses the pool's key. The target stays routable, so requests meet the rejection
themselves and get the credentials error (502 `upstream_credentials_rejected`, dispatch/retry_policy.py) rather than
"no replica" (503 overloaded), and on-call gets an ERROR line naming the pool. A server split into DP-rank targets is
probed once and the answer applies to every rank. litellm targets have no probe (their provider is
assumed up; the passive breaker still guards them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum

import httpx

from gateway.backends.polls import PollClient
from gateway.background import BackgroundTask
from gateway.config import HealthChecks
from gateway.observability.metrics import GatewayMetrics
from gateway.upstreams import Target, UpstreamRegistry

log = logging.getLogger("gateway.health")
UNHEALTHY_AFTER = 2
BUSY_NOT_DEAD = "/ping"  # SGLang's cheap liveness check (every release)
CREDENTIALS_LOG_S = 60.0  # one ERROR line a minute per pool whose key the probe sees rejected


class Probe(Enum):
    UP = "up"
    DOWN = "down"
    CREDENTIALS = "credentials"  # up, but the pool's key is refused


class HealthChecker:
    def __init__(self, registry: UpstreamRegistry, client: httpx.AsyncClient, cfg: HealthChecks, metrics: GatewayMetrics,
                 gets: PollClient | None = None) -> None:
        self.registry = registry
        self.client = client
        self._own_gets = gets is None
        self.gets = PollClient(client) if gets is None else gets  # the probes' GETs (backends/polls.py)
        self.cfg = cfg
        self.metrics = metrics
        self._bg = BackgroundTask(self._run, "health-checks")
        self._creds_logged: dict[str, float] = {}

    def start(self) -> None:
        if self.cfg.enabled:
            self._bg.start()

    async def stop(self) -> None:
        await self._bg.stop()
        if self._own_gets:
            self.gets.close()

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

    async def _probe(self, t: Target, path: str) -> Probe:
        headers = {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}
        try:
            r = await self.gets.get(f"{t.base_url}{path}", headers=headers, timeout=self.cfg.timeout_s)
        except httpx.HTTPError:
            return Probe.DOWN
        if r.status_code in (401, 403):
            return Probe.CREDENTIALS
        return Probe.UP if r.status_code == 200 else Probe.DOWN

    async def _check(self, targets: list[Target]) -> None:
        t = targets[0]
        probe = await self._probe(t, t.health_path)
        if probe is Probe.DOWN and t.caps.engine_loads and t.health_path != BUSY_NOT_DEAD:
            probe = await self._probe(t, BUSY_NOT_DEAD)  # a slow /health behind a long prefill: busy, not dead
        ok = probe is not Probe.DOWN
        if probe is Probe.CREDENTIALS:
            self._log_credentials(t)
        for x in targets:
            s = x.state
            s.credentials_rejected = probe is Probe.CREDENTIALS
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

    def _log_credentials(self, t: Target) -> None:
        now = time.monotonic()
        if now - self._creds_logged.get(t.pool, float("-inf")) >= CREDENTIALS_LOG_S:
            self._creds_logged[t.pool] = now
            log.error("the health probe of pool %s (replica %s) was refused with the pool's credentials: check its "
                      "api_key_env; requests to it get upstream_credentials_rejected", t.pool, t.name)

    def unreachable(self, t: Target) -> None:
        """The dispatcher could not connect: unhealthy at once (no request waits on it again) until a probe answers."""
        if t.state.healthy:
            log.warning("replica %s of pool %s refused a connection: marked unhealthy until a probe answers", t.name,
                        t.pool)
        t.state.healthy = False
        self.metrics.replica_healthy.labels(t.pool, t.name).set(0)
