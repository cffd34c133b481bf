"""The chaos suite's fleet as separate processes on loopback: a private Redis (AOF on, its own directory), simulated
SGLang replicas one process each (so one can be SIGKILLed), and two `gateway serve` instances sharing that Redis, with
a small load balancer in front that sends only to instances whose `/readyz` answers 200 (as Kubernetes does)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from loadtests.procs import Proc
from tests.support import RedisServer, free_port

ADMIN_TOKEN = "chaos-admin-token"
BODY_READ_S = 2.0  # the gateway's body-read timeout here: a client that declares more than it sends waits this long
# tenant -> (key, policy fields). "steady" is the well-behaved traffic every scenario measures.
TENANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "steady": ("sk-chaos-steady", {}),
    "other": ("sk-chaos-other", {}),
    "poison": ("sk-chaos-poison", {}),
    "capped": ("sk-chaos-capped", {"max_concurrent": 5}),
    "capped_fleet": ("sk-chaos-capped-fleet", {"max_concurrent": 5, "max_concurrent_scope": "fleet"}),
    # a cap that fits ~200 of the chaos chat body's requests (~$0.0002 each: 543 prompt tokens, most of them cached,
    # and 24 out), and ~16 of their reservations at once ($0.00276: the usage bound, 4 x 543 + 512 prompt tokens
    # uncached at $1/Mtok and 24 out at $3.2/Mtok): a burst of 400 is cut by the budget, not by one request
    "budget": ("sk-chaos-budget", {"budget": {"usd_per_day": 0.045}}),
    "rate": ("sk-chaos-rate", {"rate_limits": {"requests_per_minute": 50}}),
    "rate400": ("sk-chaos-rate400", {"rate_limits": {"requests_per_minute": 50}}),
    "fuzz": ("sk-chaos-fuzz", {}),
    # every request sends the same x-request-id: a budget whose cap stops the sequence, a fleet-wide cap, a bystander
    "reuse": ("sk-chaos-reuse", {"budget": {"usd_per_day": 0.04}}),  # ~190 of the 300 sequential requests
    "reuse_fleet": ("sk-chaos-reuse-fleet", {"max_concurrent": 5, "max_concurrent_scope": "fleet"}),
    "reuse_b": ("sk-chaos-reuse-b", {}),
}
HEADER_READ_S = 6.0  # the gateways' http.header_read_s here: slowloris connections are cut this long after opening.
# Not shorter: a client whose own loop is busy with a burst of hundreds of requests (the budget and rate bursts) can
# take seconds between opening a connection and writing its request, and a connection that sent nothing by then is
# closed unanswered (a lost request in the table).


class Stack:
    def __init__(self, replicas: int = 3, time_scale: float = 20.0, log_dir: Path | None = None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="gw-chaos-"))
        self.logs = log_dir or self.work
        self.logs.mkdir(parents=True, exist_ok=True)
        self.time_scale = time_scale
        self.redis = RedisServer(appendonly=True)  # AOF in its own directory: a restart keeps what was written
        self.sim_ports = [free_port() for _ in range(replicas)]
        self.sims: list[Proc] = [self._sim(i) for i in range(replicas)]
        for s in self.sims:
            s.wait_ready(30)
        self.gw_ports = [free_port(), free_port()]
        self.admin_ports = [free_port(), free_port()]  # each instance's admin listener (admin API, /metrics)
        self.config_path = self.work / "gateway.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config()))
        self.gateways: list[Proc | None] = [self._gateway(i) for i in range(2)]
        for g in self.gateways:
            assert g is not None
            g.wait_ready(60)

    # -- processes ------------------------------------------------------------------------------------------------
    def _sim(self, i: int) -> Proc:
        port = self.sim_ports[i]
        cmd = [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", "1", "--port", str(port), "--seed", str(i),
               "--time-scale", str(self.time_scale), "--set", "enable_cache_report=true"]
        return Proc(f"sim-{i}", cmd, f"http://127.0.0.1:{port}/ping", log=self.logs / f"sim-{i}.log")

    def _gateway(self, i: int) -> Proc:
        port = self.gw_ports[i]
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path), "--port", str(port),
               "--admin-port", str(self.admin_ports[i]), "--drain-timeout", "30"]
        return Proc(f"gateway-{i}", cmd, f"http://127.0.0.1:{port}/readyz", log=self.logs / f"gateway-{i}.log")

    def config(self) -> dict[str, Any]:
        tenants = [{"name": n, "api_key_hashes": [hash_key(k)], "models": ["glm-5.2"], **extra}
                   for n, (k, extra) in TENANTS.items()]
        ts = self.time_scale
        return {
            "models": [{"name": "glm-5.2", "pools": ["mi355x"]}],
            "pools": [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2",
                       "replicas": [{"name": f"sim-{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(self.sim_ports)],
                       "pricing": {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2,
                                   "output_per_mtok": 3.2},
                       # the simulator runs `ts` times faster than real time: the timing model in wall time
                       "timing": {"base_s": 0.14 / ts, "prefill_tokens_per_s": 16700 * ts, "decode_step_s": 0.0467 / ts}}],
            "tenants": tenants,
            "timeouts": {"connect": 1.0, "first_byte": 30.0, "idle": 30.0, "total": 60.0, "body_read": BODY_READ_S},
            "health": {"interval_s": 1.0, "timeout_s": 2.0},
            "routing": {"redis_url": self.redis.url, "ttft_sla_ms": 2220 / ts, "redis_timeout_s": 0.25},
            "admin": {"token_hashes": [hash_key(ADMIN_TOKEN)]},
            "http": {"header_read_s": HEADER_READ_S},
            "shutdown": {"readiness_drain_s": 1.5},  # the balancer polls every 0.1 s: 1.5 s is ample here
        }

    def kill_sim(self, i: int) -> None:
        os.killpg(self.sims[i].pid, signal.SIGKILL)
        self.sims[i].proc.wait(10)

    def restart_sim(self, i: int) -> None:
        self.sims[i] = self._sim(i)
        self.sims[i].wait_ready(30)

    def sigterm_gateway(self, i: int) -> None:
        g = self.gateways[i]
        assert g is not None
        os.killpg(g.pid, signal.SIGTERM)

    def wait_gateway_exit(self, i: int, timeout: float = 60.0) -> int | None:
        g = self.gateways[i]
        assert g is not None
        try:
            return g.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart_gateway(self, i: int) -> None:
        self.gateways[i] = self._gateway(i)
        self.gateways[i].wait_ready(60)  # type: ignore[union-attr]

    def stop(self) -> None:
        for g in self.gateways:
            if g is not None:
                g.stop()
        for s in self.sims:
            s.stop()
        self.redis.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    # -- addresses ------------------------------------------------------------------------------------------------
    @property
    def gw_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gw_ports]

    @property
    def admin_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.admin_ports]

    @property
    def sim_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.sim_ports]


class LoadBalancer:
    """Round-robin over the instances whose /readyz answered 200 at the last poll (every 100 ms), like a Service
    whose endpoints follow readiness. It never retries: a request it sent to a closed listener is lost."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient) -> None:
        self.urls = urls
        self.client = client
        self.ready = [True] * len(urls)
        self.readiness_log: list[tuple[float, int, int]] = []  # (time, instance, status or -1 for refused)
        self._i = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _poll(self) -> None:
        while True:
            for i, u in enumerate(self.urls):
                try:
                    r = await self.client.get(f"{u}/readyz", timeout=0.5)
                    code = r.status_code
                except httpx.HTTPError:
                    code = -1
                self.ready[i] = code == 200
                self.readiness_log.append((time.monotonic(), i, code))
            await asyncio.sleep(0.1)

    def pick(self) -> str:
        n = len(self.urls)
        for _ in range(n):
            self._i = (self._i + 1) % n
            if self.ready[self._i]:
                return self.urls[self._i]
        return self.urls[self._i]  # none ready: send anyway (and count what happens)
