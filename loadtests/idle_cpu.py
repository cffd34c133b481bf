"""One gateway in front of N simulated SGLang replicas and no traffic: its CPU per second of wall time (its polls of
the engines, health probes, heartbeats, timers), read from procfs over a window, repeated.

    .venv/bin/python -m loadtests.idle_cpu --replicas 8 --seconds 20 --repeat 3 [--redis] [--profile out.svg]

`--redis`: the gateway shares its state through a private redis-server (as fleet_trace's gateway does: its load
heartbeat and watchers run too). `--profile PATH`: py-spy (`PYSPY`, default `py-spy` on PATH) records the gateway
over one more window into a flame graph (PATH.svg) and a collapsed-stack file (PATH.txt). The simulators' own CPU is
reported apart: answering the polls costs them, not the gateway.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from gateway.config import hash_key
from loadtests.procs import Proc, cpu_seconds

KEY = "sk-idle"


def gateway_config(urls: list[str], redis_url: str | None, polls: bool = True) -> dict[str, object]:
    return {**({} if polls else {"health": {"enabled": False}}),
            "models": [{"name": "glm-5.2", "pools": ["mi355x"]}],
            "pools": [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2",
                       "replicas": [{"name": f"mi355x-{i}", "url": u} for i, u in enumerate(urls)]}],
            "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
            "routing": {"redis_url": redis_url, "redis_prefix": "idle:"} if redis_url else {},
            "observability": {"log_requests": False}}


def window(pids: list[int], seconds: float) -> list[float]:
    """CPU ms per wall second of each process tree over `seconds`."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return [(cpu_seconds(p) - c) / wall * 1000 for p, c in zip(pids, c0, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0, help="one measuring window")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--settle", type=float, default=5.0, help="seconds after readiness before the first window")
    p.add_argument("--redis", action="store_true", help="share state through a private redis-server")
    p.add_argument("--no-polls", action="store_true", help="health checks and engine polls off: the floor under them")
    p.add_argument("--profile", default=None, help="py-spy flame graph of the gateway over one more window")
    p.add_argument("--port", type=int, default=19500)
    p.add_argument("--sim-port", type=int, default=19600)
    p.add_argument("--redis-port", type=int, default=19590)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-idle-cpu-"))
    procs: list[Proc] = []
    try:
        sim = Proc("sim", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--report-incarnation",
                           "--replicas", str(a.replicas), "--port", str(a.sim_port)],
                   f"http://127.0.0.1:{a.sim_port}/ping", log=work / "sim.log")
        procs.append(sim)
        sim.wait_ready()
        redis_url = None
        if a.redis:
            procs.append(Proc("redis", ["redis-server", "--port", str(a.redis_port), "--bind", "127.0.0.1", "--save", "",
                                        "--appendonly", "no", "--dir", str(work)], "http://127.0.0.1:1/",
                              log=work / "redis.log"))
            time.sleep(0.5)
            redis_url = f"redis://127.0.0.1:{a.redis_port}/0"
        urls = [f"http://127.0.0.1:{a.sim_port + i}" for i in range(a.replicas)]
        (work / "gw.yaml").write_text(yaml.safe_dump(gateway_config(urls, redis_url, not a.no_polls)))
        gw = Proc("gateway", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "gw.yaml"),
                              "--port", str(a.port)], f"http://127.0.0.1:{a.port}/healthz", log=work / "gw.log")
        procs.append(gw)
        gw.wait_ready()
        time.sleep(a.settle)
        runs = [window([gw.pid, sim.pid], a.seconds) for _ in range(a.repeat)]
        g, s = [r[0] for r in runs], [r[1] for r in runs]
        print(f"{a.replicas} simulated replicas{', redis' if a.redis else ''}{', no polls' if a.no_polls else ''}, {a.repeat} windows of {a.seconds:g} s")
        print(f"gateway idle CPU ms/s: {' '.join(f'{x:.1f}' for x in g)} (median {statistics.median(g):.1f})")
        print(f"simulators' CPU ms/s:  {' '.join(f'{x:.1f}' for x in s)} (median {statistics.median(s):.1f})")
        if a.profile:
            spy = os.environ.get("PYSPY", "py-spy")
            out = Path(a.profile)
            for fmt, suffix in (("flamegraph", ".svg"), ("raw", ".txt")):
                subprocess.run([spy, "record", "-p", str(gw.pid), "-d", str(int(a.seconds)), "-r", "200", "-f", fmt,
                                "-o", str(out.with_suffix(suffix)), "--nonblocking"], check=True,
                               stdout=subprocess.DEVNULL)
            print(f"wrote {out.with_suffix('.svg')} and {out.with_suffix('.txt')}")
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    main()
