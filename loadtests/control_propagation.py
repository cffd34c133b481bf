"""How fast an on-call change reaches another gateway instance: two `gateway serve` processes on one private
redis-server; drain / undrain a replica, and change a tenant's requests/min live, through A's admin API and time
until B's admin API shows it (for the tenant: the effective policy B's request path reads).

    .venv/bin/python -m loadtests.control_propagation [--trials 20]

Measured from A's response to the first poll of B (polled back to back, ~1 ms apart) that shows the change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from gateway.config import hash_key
from loadtests.procs import Proc

ADMIN = "adm-bench"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--port", type=int, default=19700)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-ctl-"))
    redis_port, sim_port, ports = a.port + 90, a.port + 50, [a.port, a.port + 2]
    procs = [Proc("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(work)], "http://127.0.0.1:1/"),
             Proc("sim", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", "2", "--port", str(sim_port)],
                  f"http://127.0.0.1:{sim_port}/ping")]
    try:
        procs[1].wait_ready()
        cfg = {"models": [{"name": "glm-5.2", "pools": ["p"]}],
               "pools": [{"name": "p", "kind": "sglang", "model": "zai-org/GLM-5.2",
                          "replicas": [{"name": f"p-{i}", "url": f"http://127.0.0.1:{sim_port + i}"} for i in range(2)]}],
               "tenants": [{"name": "t", "api_key_hashes": [hash_key("sk-t")], "models": ["glm-5.2"]}],
               "routing": {"redis_url": f"redis://127.0.0.1:{redis_port}/0"}, "admin": {"token_hashes": [hash_key(ADMIN)]}}
        (work / "gw.yaml").write_text(yaml.safe_dump(cfg))
        for port in ports:
            procs.append(Proc(f"gw-{port}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "gw.yaml"),
                                             "--port", str(port)], f"http://127.0.0.1:{port}/healthz"))
            procs[-1].wait_ready()
        h = {"authorization": f"Bearer {ADMIN}"}
        delays = []
        # one step per trial, after its delay is taken (the monitor thread off: B is polled ~1 ms apart)
        tqdm.monitor_interval = 0
        with httpx.Client(headers=h, trust_env=False, timeout=5) as c, \
                tqdm(total=a.trials, unit="trial", file=sys.stderr, leave=False, disable=a.no_progress) as bar:
            for i in range(a.trials):
                action = "drain" if i % 2 == 0 else "undrain"
                c.post(f"http://127.0.0.1:{ports[0] + 1}/admin/replicas/p-0/{action}").raise_for_status()
                t0 = time.perf_counter()
                while True:
                    # the admin listeners: port + 1
                    reps = c.get(f"http://127.0.0.1:{ports[1] + 1}/admin/replicas").json()["replicas"]
                    if next(r for r in reps if r["name"] == "p-0")["drained"] == (action == "drain"):
                        break
                    if time.perf_counter() - t0 > 5:
                        raise RuntimeError("instance B did not see the change within 5 s")
                delays.append((time.perf_counter() - t0) * 1000)
                bar.update()
                time.sleep(0.1)
        print(f"drain/undrain on A seen by B, {a.trials} trials: median {statistics.median(delays):.1f} ms, "
              f"max {max(delays):.1f} ms (includes one admin GET on B, ~1 ms)")
        limits = []
        with httpx.Client(headers=h, trust_env=False, timeout=5) as c:
            for i in range(a.trials):
                rpm = 100 + i
                c.patch(f"http://127.0.0.1:{ports[0] + 1}/admin/tenants/t/policy",
                        json={"rate_limits": {"requests_per_minute": rpm}}).raise_for_status()
                t0 = time.perf_counter()
                while c.get(f"http://127.0.0.1:{ports[1] + 1}/admin/tenants/t/policy").json()["effective"]["rate_limits"][
                        "requests_per_minute"] != rpm:
                    if time.perf_counter() - t0 > 5:
                        raise RuntimeError("instance B did not apply the tenant change within 5 s")
                limits.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.1)
        print(f"tenant requests/min changed on A in force on B, {a.trials} trials: median "
              f"{statistics.median(limits):.1f} ms, max {max(limits):.1f} ms (includes one admin GET on B, ~1 ms)")
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    main()
