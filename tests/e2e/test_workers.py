"""`gateway serve --workers 2`: a real supervisor and its two worker processes on one port, sharing a real Redis in
front of simulated replicas. The workers must behave as two instances do: connections spread over both, prefix
affinity and an on-call drain holding across both, a tenant's rate limit held across both (not one allowance per
worker), one /metrics summing both, and SIGTERM draining both (an in-flight stream completes) before the supervisor
exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, KEY_B, config, sglang_pool
from tests.support import env_without_proxies, free_port, start_sims, stop_processes, wait_http, wait_until

LIMIT = 10  # tenant-b's requests per minute, fleet-wide


def lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for raw in log.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


def served_by(log: Path, tenant: str) -> Counter[int]:
    """Requests of `tenant` per worker pid, from the request lines."""
    return Counter(x["pid"] for x in lines(log) if x.get("event") == "request" and x.get("tenant") == tenant)


def ask(port: int, key: str, messages: list[dict[str, str]] | None = None) -> httpx.Response:
    # a new connection each time: the kernel picks a worker per connection
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": "glm-5.2", "messages": messages or [{"role": "user", "content": "hi"}],
                            "max_tokens": 4}, timeout=30, trust_env=False)


def pids_of(log: Path, request_ids: set[str]) -> set[int]:
    return {x["pid"] for x in lines(log) if x.get("event") == "request" and x.get("request_id") in request_ids}


def worker_pids(supervisor: int) -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == supervisor:
                    pids.add(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def test_two_workers_share_limits_metrics_and_drain_together(redis_server, tmp_path):
    sims, _ = start_sims(2, time_scale=1.0)
    tenants = [{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]},
               {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["glm-5.2"],
                "rate_limits": {"requests_per_minute": LIMIT}}]
    cfg = config([sglang_pool("p", sims.urls)], tenants=tenants, admin={"token_hashes": [hash_key("adm")]},
                 routing={"redis_url": redis_server.url, "redis_prefix": f"wk{time.monotonic_ns()}:"})
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port, admin = free_port(), free_port()
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port),
                                 "--admin-port", str(admin), "--workers", "2", "--drain-delay", "0"],
                                env=env_without_proxies(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{admin}/healthz", timeout=60, proc=proc)  # worker 0 serves the admin listener
        wait_until(lambda: sum(1 for x in lines(log) if x.get("event") == "listening") == 2, timeout=60,
                   what="both workers listening")
        pids = worker_pids(proc.pid)
        assert len(pids) == 2

        for _ in range(20):
            assert ask(port, KEY_A).status_code == 200
        wait_until(lambda: sum(served_by(log, "tenant-a").values()) == 20, timeout=10, what="20 request lines")
        spread = served_by(log, "tenant-a")
        assert set(spread) == pids, spread  # both workers served (each line names its pid)

        # prefix affinity held across workers (the index is in Redis): a prefix placed through one worker is
        # served from the same replica, with its cached tokens, whichever worker a follow-up reaches
        placed: set[str] = set()
        for g in range(3):
            shared = {"role": "system", "content": f"[group {g}] " + "shared tool schema and agent memory " * 500}
            first = ask(port, KEY_A, [shared, {"role": "user", "content": "first"}])
            ids = {first.headers["x-request-id"]}
            for k in range(4):
                r = ask(port, KEY_A, [shared, {"role": "user", "content": f"follow-up {k}"}])
                assert r.headers["x-gateway-replica"] == first.headers["x-gateway-replica"]
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4000
                ids.add(r.headers["x-request-id"])
            placed |= ids
        wait_until(lambda: len(pids_of(log, placed)) == 2, timeout=10, what="affinity requests on both workers")

        # an on-call drain made through the admin listener (worker 0) reaches worker 1 through Redis
        drained = first.headers["x-gateway-replica"]
        r = httpx.post(f"http://127.0.0.1:{admin}/admin/replicas/{drained}/drain",
                       headers={"authorization": "Bearer adm"}, trust_env=False)
        assert r.status_code == 200

        def avoided() -> bool:
            rs = [ask(port, KEY_A) for _ in range(8)]
            return all(x.headers["x-gateway-replica"] != drained for x in rs) and \
                len(pids_of(log, {x.headers["x-request-id"] for x in rs})) == 2
        wait_until(avoided, timeout=20, what="the drain obeyed by both workers")

        codes = Counter(ask(port, KEY_B).status_code for _ in range(2 * LIMIT))
        # one allowance for the fleet: a per-worker one would have let up to 2 x LIMIT through (a bucket refills
        # continuously, so one more may have come due while the requests ran)
        assert LIMIT <= codes[200] <= LIMIT + 1, codes
        assert codes[429] == 2 * LIMIT - codes[200]
        wait_until(lambda: sum(served_by(log, "tenant-b").values()) == 2 * LIMIT, timeout=10, what="tenant-b lines")
        assert set(served_by(log, "tenant-b")) == pids  # the refusals came from both workers

        def total(tenant: str, status: str) -> float:
            text = httpx.get(f"http://127.0.0.1:{admin}/metrics", trust_env=False).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("gateway_requests_total{") and f'tenant="{tenant}"' in line
                       and f'status="{status}"' in line)

        # worker 0 answers /metrics with the sum over both workers' counters
        # every tenant-a request was answered 200 and logged by the worker that served it
        wait_until(lambda: total("tenant-a", "200") == sum(served_by(log, "tenant-a").values()) >= 20 + 15 + 8,
                   timeout=10, what="tenant-a's requests of both workers in /metrics")
        assert total("tenant-b", "200") == codes[200] and total("tenant-b", "429") == codes[429]

        # SIGTERM while a stream is in flight: it completes, then every worker and the supervisor exit
        got: dict[str, Any] = {}
        first = threading.Event()

        def stream() -> None:
            body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 60,
                    "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60,
                              headers={"authorization": f"Bearer {KEY_A}"}, trust_env=False) as r:
                chunks = []
                for line in r.iter_lines():
                    chunks.append(line)
                    first.set()
                got["status"], got["chunks"] = r.status_code, chunks
            first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert got["status"] == 200 and "data: [DONE]" in got["chunks"]  # the whole stream, not a cut one
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:  # say which process is where in its shutdown
            events = [x for x in lines(log) if x.get("event") not in ("request", None)]
            raise AssertionError(f"the supervisor did not exit within 60 s of SIGTERM; workers alive: "
                                 f"{sorted(p for p in pids if os.path.exists(f'/proc/{p}'))}; events: {events}") from None
        assert code == 0
        assert not any(os.path.exists(f"/proc/{p}") for p in pids)  # both workers ended (and were reaped)
    finally:
        stop_processes([proc])
        sims.stop()


def test_workers_without_shared_state_are_refused(tmp_path):
    """In-memory state cannot be shared between processes: N workers would each enforce a private copy of every
    limit and budget, so the start is refused with a message naming the setting."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config([sglang_pool("p", ["http://127.0.0.1:9"])])))
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(free_port()),
                        "--admin-port", str(free_port()), "--workers", "2"], env=env_without_proxies(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "routing.redis_url" in r.stderr
