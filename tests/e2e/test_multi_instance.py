"""Three `gateway serve` processes (separate interpreters, separate hash seeds) sharing one real Redis in front of
the same simulated fleet hold prefix affinity: a prefix placed through one instance is served from the same replica
through every other, with its cached tokens; and an on-call drain made on one reaches the other two."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import yaml
from openai import OpenAI

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool
from tests.support import env_without_proxies, start_serves, start_sims, stop_processes, wait_until


def test_three_serve_processes_share_placement_through_redis(redis_server, tmp_path):
    sims, _ = start_sims(4)
    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key("adm")]},
                 routing={"redis_url": redis_server.url, "redis_prefix": f"mi{time.monotonic_ns()}:"})
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def argv(i: int, port: int, admin_port: int) -> list[str]:
        return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port),
                "--admin-port", str(admin_port)]

    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Python's own hash differs per process
        procs, ports, admin_ports = start_serves(3, argv, lambda i: {**env_without_proxies(),
                                                                     "PYTHONHASHSEED": str(100 + i)})
        clients = [OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=KEY_A, max_retries=0) for p in ports]

        def ask(c: OpenAI, group: int, question: str):
            msgs = [{"role": "system", "content": f"[group {group}] " + "shared tool schema and agent memory " * 500},
                    {"role": "user", "content": question}]
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=msgs, max_tokens=2)
            return r.headers["x-gateway-replica"], r.parse().usage.prompt_tokens_details.cached_tokens

        placements = set()
        for g in range(6):
            first, _ = ask(clients[g % 3], g, "first question")  # placed by one instance
            placements.add(first)
            for k in (1, 2):  # then asked through the two others, with new text after the shared prefix
                replica, cached = ask(clients[(g + k) % 3], g, f"follow-up {k}")
                assert replica == first
                assert cached >= 4000  # the 4,500-token shared prefix came from that replica's cache
        assert len(placements) >= 2  # cold prefixes spread over the fleet, not all on one replica

        r = httpx.post(f"http://127.0.0.1:{admin_ports[0]}/admin/replicas/{sorted(placements)[0]}/drain",
                       headers={"authorization": "Bearer adm"})
        assert r.status_code == 200
        for port in admin_ports[1:]:
            wait_until(lambda port=port: any(x["drained"] for x in httpx.get(f"http://127.0.0.1:{port}/admin/replicas",
                                                                   headers={"authorization": "Bearer adm"}).json()["replicas"]),
                       timeout=1.0, what=f"the drain on instance :{port}")
    finally:
        stop_processes(procs)
        sims.stop()
