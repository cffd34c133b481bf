"""`gateway serve` and `gateway demo`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from gateway.app import create_admin_app, create_app
from gateway.config import ConfigError, hash_key, load_config, parse_config
from gateway.servers import free_ports, make_server, serve_all, taken_port_error


async def _serve_gateway(app: Any, host: str, port: int, drain_timeout: float, drain_delay: float = 0.0,
                         extra: list[Any] | None = None, on_started: Any = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down in the order load balancers expect:

    1. `/readyz` answers 503 for `drain_delay` seconds while every request is still served (the balancer notices
       and stops sending; a second signal skips the wait);
    2. the listener closes (uvicorn stops accepting; idle keep-alive connections are closed);
    3. in-flight requests and streams run to completion, up to `drain_timeout` seconds;
    then the simulated replicas of the demo (`extra`) stop."""
    server = make_server(app, host, port, timeout_graceful_shutdown=drain_timeout, timeout_keep_alive=75,
                         openai_errors=True)
    loop = asyncio.get_running_loop()
    pending: list[asyncio.TimerHandle] = []

    def stop_now() -> None:
        for h in pending:
            h.cancel()
        server.should_exit = True

    def on_signal() -> None:
        st = getattr(app.state, "gateway", None)
        if st is None or st.draining or drain_delay <= 0:  # second signal, or no delay asked: stop accepting now
            if st is not None:
                st.draining = True
            stop_now()
            return
        st.draining = True
        print(f"gateway: draining; /readyz answers 503, the listener closes in {drain_delay:g} s", file=sys.stderr,
              flush=True)
        pending.append(loop.call_later(drain_delay, stop_now))

    await serve_all([server] + (extra or []), on_started=on_started, on_signal=on_signal)


def serve(a: argparse.Namespace) -> int:
    try:
        cfg = load_config(a.config)
        app = create_app(cfg)  # loads the policy directory: an invalid one fails here too
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    taken = taken_port_error("gateway serve", a.host, [a.port], "--port") or (
        taken_port_error("gateway serve", a.host, [cfg.admin.port], "admin.port in the config")
        if cfg.admin.port is not None else None)
    if taken:
        print(taken, file=sys.stderr)
        return 2
    extra = []
    if cfg.admin.port is not None:
        extra.append(make_server(create_admin_app(app), a.host, cfg.admin.port, openai_errors=True))

    def started() -> None:
        admin = f", admin API on http://{a.host}:{cfg.admin.port}/admin" if cfg.admin.port is not None else ""
        print(f"gateway listening on http://{a.host}:{a.port}{admin}", file=sys.stderr, flush=True)

    delay = cfg.shutdown.readiness_drain_s if a.drain_delay is None else a.drain_delay
    asyncio.run(_serve_gateway(app, a.host, a.port, a.drain_timeout, delay, extra=extra, on_started=started))
    return 0


def demo_config(sim_urls: list[str], api_key: str, b200_urls: list[str] | None = None) -> dict[str, Any]:
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
        "tenants": [{"name": "demo", "api_key_hashes": [hash_key(api_key)], "models": ["glm-5.2"]}],
        "health": {"interval_s": 2.0, "timeout_s": 3.0},
    }


def demo(a: argparse.Namespace) -> int:
    from gateway.sim.profiles import profile
    from gateway.sim.replica import Replica
    from gateway.sim.server import create_sim_app

    taken = taken_port_error("gateway demo", a.host, [a.port], "--port")
    sim_ports = free_ports("127.0.0.1", a.replicas) if not a.sim_port else [a.sim_port + i for i in range(a.replicas)]
    taken = taken or taken_port_error("gateway demo", "127.0.0.1", sim_ports, "--sim-port (or 0 for free ports)")
    if taken:
        print(taken, file=sys.stderr)
        return 2
    cfg_sim = profile("mi355x-glm52-tp4", time_scale=a.time_scale, enable_cache_report=True)  # as `--enable-cache-report`
    sims = [make_server(create_sim_app(Replica(cfg_sim.with_overrides(seed=i), name=f"mi355x-{i}")), "127.0.0.1", p,
                        timeout_keep_alive=5) for i, p in enumerate(sim_ports)]
    cfg = parse_config(demo_config([f"http://127.0.0.1:{p}" for p in sim_ports], a.api_key), "<demo>")
    app = create_app(cfg)
    base = f"http://{a.host}:{a.port}/v1"

    def started() -> None:
        print(f"""
Inference gateway demo is up.
  gateway      {base}   (model "glm-5.2", API key "{a.api_key}")
  replicas     {", ".join(f"http://127.0.0.1:{p}" for p in sim_ports)}   (simulated SGLang, MI355X TP4, time scale {a.time_scale})
  metrics      http://{a.host}:{a.port}/metrics

Point the OpenAI SDK at it:

    from openai import OpenAI
    client = OpenAI(base_url="{base}", api_key="{a.api_key}")
    r = client.chat.completions.create(model="glm-5.2", messages=[{{"role": "user", "content": "Hello"}}], max_tokens=32)
    print(r.choices[0].message.content, r.usage)

or: curl {base}/chat/completions -H 'authorization: Bearer {a.api_key}' -H 'content-type: application/json' \\
      -d '{{"model": "glm-5.2", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32, "stream": true}}'

Ctrl-C stops it (in-flight requests finish first).
""", flush=True)

    asyncio.run(_serve_gateway(app, a.host, a.port, 30.0, extra=sims, on_started=started))
    return 0
