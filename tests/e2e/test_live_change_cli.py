"""The on-call loop end to end: two `gateway serve` processes on one real Redis; a tenant's rate limit raised with
`gateway admin tenant` on instance A is enforced on instance B, then `gateway admin undo` on A puts B back on the
policy file's limit; the history shows both changes with before and after. The time from the CLI's return to B
enforcing is printed (run with -s to see it); the test waits on the condition, it asserts no time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import yaml

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool
from tests.support import env_without_proxies, start_serves, start_sims, stop_processes, wait_until


def cli(base: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "admin", "--url", base, "--token", "adm",
                          "--actor", "oncall", "-o", "json", *args], env=env_without_proxies(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def ask(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                      json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


def enforcing(base: str, limit: int, admitted: bool) -> bool:
    """B states `limit` as the tenant's requests/min and admits (or refuses) by it."""
    r = ask(base)
    return r.headers.get("x-ratelimit-limit-requests") == str(limit) and (r.status_code == 200) == admitted


def test_rate_limit_raised_and_undone_through_the_cli_reaches_the_other_instance(redis_server, tmp_path):
    sims, _ = start_sims(2)
    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key("adm")]},
                 routing={"redis_url": redis_server.url, "redis_prefix": f"lcc{time.monotonic_ns()}:"},
                 tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
                           "rate_limits": {"requests_per_minute": 2}}])
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs, ports, admin_ports = start_serves(2, lambda i, p, ap: [
            sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(p), "--admin-port", str(ap)],
            lambda i: env_without_proxies())
        b = f"http://127.0.0.1:{ports[1]}"  # B's client port: what its clients see
        admin_a, admin_b = (f"http://127.0.0.1:{p}" for p in admin_ports)
        wait_until(lambda: enforcing(b, 2, admitted=False), timeout=30, what="B refusing past 2 requests/min")

        raised = cli(admin_a, "tenant", "tenant-a", "--rpm", "600")
        t0 = time.monotonic()
        wait_until(lambda: enforcing(b, 600, admitted=True), timeout=30, what="B admitting at 600/min")
        up = time.monotonic() - t0
        assert raised["before"]["rate_limits"]["requests_per_minute"] == 2
        assert raised["after"]["rate_limits"]["requests_per_minute"] == 600

        undone = cli(admin_a, "undo")
        t1 = time.monotonic()
        wait_until(lambda: ask(b).headers.get("x-ratelimit-limit-requests") == "2", timeout=30, what="B back at 2/min")
        down = time.monotonic() - t1
        # and refusing by it: the probes above and here use up what the 2/min bucket holds
        wait_until(lambda: enforcing(b, 2, admitted=False), timeout=30, what="B refusing again at 2/min")
        refused = time.monotonic() - t1
        assert undone["undone"] == raised["audit_id"]

        entries = {e["id"]: e for e in cli(admin_b, "history")["entries"]}
        assert entries[raised["audit_id"]]["who"].endswith("(oncall)")
        assert entries[raised["audit_id"]]["undone_by"] == undone["audit_id"]
        assert entries[undone["audit_id"]]["before"]["rate_limits"]["requests_per_minute"] == 600
        assert entries[undone["audit_id"]]["after"]["rate_limits"]["requests_per_minute"] == 2
        print(f"\nlive change reached instance B: raise {up:.3f} s (admitting at 600/min), undo {down:.3f} s (stating "
              f"2/min; refusing by it {refused:.3f} s) after the CLI returned")
    finally:
        stop_processes(procs)
        sims.stop()
