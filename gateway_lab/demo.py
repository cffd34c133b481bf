"""`gateway demo`: two simulated MI355X replicas on free ports and the gateway in front of them, in-memory state
(the README's first command)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from gateway.app import create_admin_app, create_app
from gateway.config import hash_key, parse_config
from gateway.serve import serve_gateway
from gateway.servers import free_ports, make_server, taken_port_error
from gateway_lab.sim.profiles import profile
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.server import create_sim_app


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="a simulated MI355X pool behind the gateway, in-memory state")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default="sk-demo")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sim-port", type=int, default=0,
                   help="first replica port (replicas use SIM_PORT..SIM_PORT+N-1); 0: free ports the OS picks")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--admin-port", type=int, default=None, help="the admin listener (admin API, /metrics, "
                   "`gateway admin --url`); default: --port + 1")
    p.add_argument("--admin-token", default="admin-demo", help="the demo's admin token (loopback only)")
    p.set_defaults(func=demo)


def demo_config(sim_urls: list[str], api_key: str, b200_urls: list[str] | None = None,
                admin_token: str | None = None) -> dict[str, Any]:
    pools: list[dict[str, Any]] = [{
        "name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2",
        "replicas": [{"name": f"mi355x-{i}", "url": u} for i, u in enumerate(sim_urls)],
        # 4 GPUs per TP4 replica; prefill/decode capacity from the fitted MI355X model (docs/simulator.md)
        "pricing": {"type": "gpu_hour", "gpus_per_replica": 4, "usd_per_gpu_hour": 2.10,
                    "prefill_tokens_per_s": 16700, "decode_tokens_per_s": 3600},
    }]
    pool_names = ["mi355x"]
    if b200_urls:
        pools.append({"name": "b200", "kind": "sglang", "model": "zai-org/GLM-5.2",
                      "replicas": [{"name": f"b200-{i}", "url": u} for i, u in enumerate(b200_urls)],
                      "pricing": {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.2}})
        pool_names.append("b200")
    return {
        "models": [{"name": "glm-5.2", "pools": pool_names}],
        "pools": pools,
        # agents ask for their vendor's model names (Claude Code's `claude-*`, Codex's `gpt-*`): served by glm-5.2
        "tenants": [{"name": "demo", "api_key_hashes": [hash_key(api_key)], "models": ["glm-5.2"],
                     "model_aliases": [{"match": "claude-*", "model": "glm-5.2"},
                                       {"match": "gpt-*", "model": "glm-5.2"}]}],
        "health": {"interval_s": 2.0, "timeout_s": 3.0},
        "admin": {"token_hashes": [hash_key(admin_token)] if admin_token else []},
    }


def demo(a: argparse.Namespace) -> int:
    taken = taken_port_error("gateway demo", a.host, [a.port], "--port")
    sim_ports = free_ports("127.0.0.1", a.replicas) if not a.sim_port else [a.sim_port + i for i in range(a.replicas)]
    taken = taken or taken_port_error("gateway demo", "127.0.0.1", sim_ports, "--sim-port (or 0 for free ports)")
    admin_port = a.port + 1 if a.admin_port is None else a.admin_port
    taken = taken or taken_port_error("gateway demo", a.host, [admin_port], "--admin-port (default: --port + 1)")
    if taken:
        print(taken, file=sys.stderr)
        return 2
    cfg_sim = profile("mi355x-glm52-tp4", time_scale=a.time_scale, enable_cache_report=True)  # as `--enable-cache-report`
    sims = [make_server(create_sim_app(Replica(cfg_sim.with_overrides(seed=i), name=f"mi355x-{i}")), "127.0.0.1", p,
                        timeout_keep_alive=5) for i, p in enumerate(sim_ports)]
    cfg = parse_config(demo_config([f"http://127.0.0.1:{p}" for p in sim_ports], a.api_key,
                                   admin_token=a.admin_token), "<demo>")
    app = create_app(cfg)
    admin = make_server(create_admin_app(app), a.host, admin_port, openai_errors=True)
    base = f"http://{a.host}:{a.port}/v1"
    admin_url = f"http://{a.host}:{admin_port}"

    def started() -> None:
        print(f"""
Inference gateway demo is up.
  gateway      {base}   (model "glm-5.2", API key "{a.api_key}")
  replicas     {", ".join(f"http://127.0.0.1:{p}" for p in sim_ports)}   (simulated SGLang, MI355X TP4, time scale {a.time_scale})
  admin        {admin_url}   (metrics: {admin_url}/metrics; `gateway admin --url {admin_url} --token {a.admin_token} state`)

Point the OpenAI SDK at it:

    from openai import OpenAI
    client = OpenAI(base_url="{base}", api_key="{a.api_key}")
    r = client.chat.completions.create(model="glm-5.2", messages=[{{"role": "user", "content": "Hello"}}], max_tokens=32)
    print(r.choices[0].message.content, r.usage)

or: curl {base}/chat/completions -H 'authorization: Bearer {a.api_key}' -H 'content-type: application/json' \\
      -d '{{"model": "glm-5.2", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32, "stream": true}}'

Ctrl-C stops it (in-flight requests finish first).
""", flush=True)

    asyncio.run(serve_gateway(app, a.host, a.port, 30.0, extra=[admin, *sims], on_started=started))
    return 0
