"""The noisy-neighbour scenario over HTTP: two tenants through real gateway processes in front of simulated
replicas, without and with flow control, in one run.

    .venv/bin/python -m loadtests.flow_http --victim /work/shared/traces/conversation_trace.jsonl \\
        --aggressor loadtests/out/agent_trace.jsonl --nodes 4 --window-s 120 --time-scale 10

Tenant B replays the victim trace as recorded, tenant A the aggressor trace sped up to `--aggressor-x` times B's
demand (gateway_lab/replay/mix.py: the same mixer and demand unit as `gateway replay --noisy`). Two gateway
instances share one Redis; each tenant's requests alternate between them as a load balancer would spread them
(`--split`: B only on the first, A only on the second — each instance's queue then holds one tenant, and only the
shared tags tell it about the other). The simulators and the arrivals run `--time-scale` times faster
than real time; the gateways' SLA, timing and flow-control times are stated in wall seconds accordingly, and TTFTs are
reported in simulated seconds. A refusal (429/503 from flow control) is counted with its status, never as lost.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gateway.config import hash_key
from gateway.flow.settings import FlowControl
from gateway.recording.trace import TraceRecord, read_trace
from gateway_lab.replay.http import HttpResult, run_http
from gateway_lab.replay.mix import Part, demand, mix
from gateway_lab.sim.stats import nearest_rank
from loadtests.fleet_http import MI355X_PRICE, MI355X_TIMING, redis_proc, start_sims, wall_timing
from loadtests.procs import Proc
from loadtests.report import table

KEYS = {"B": "sk-flow-victim", "A": "sk-flow-aggressor"}
MODEL = "glm-5.2"


def gateway_config(a: argparse.Namespace, mi: list[str], redis_url: str, flow: bool, prefix: str) -> dict[str, Any]:
    ts = a.time_scale
    fc: dict[str, Any] = {"enabled": flow, "queue_timeout_s": 10.0 / ts, "contention_window_s": 10.0 / ts,
                          "tick_s": max(0.002, 0.02 / ts)}
    if a.under_share_priority is not None:
        fc["under_share_priority"] = a.under_share_priority
    return {"models": [{"name": MODEL, "pools": ["mi355x"]}],
            "pools": [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2", "pricing": MI355X_PRICE,
                       "timing": wall_timing(MI355X_TIMING, ts),
                       "replicas": [{"name": f"mi355x-{i}", "url": u} for i, u in enumerate(mi)]}],
            "tenants": [{"name": f"tenant-{t}", "api_key_hashes": [hash_key(k)], "models": [MODEL]}
                        for t, k in KEYS.items()],
            "routing": {"redis_url": redis_url, "redis_prefix": prefix, "ttft_sla_ms": a.sla * 1000 / ts,
                        "policy": {"type": "prefix_sla_cost", "stickiness_penalty_ms": 1000 / ts}},
            "flow": fc, "observability": {"log_requests": False},
            "timeouts": {"first_byte": 600, "total": 3000, "idle": 120}}


def tenant_row(label: str, tenant: str, res: list[HttpResult], sla: float) -> list[Any]:
    ok = [r for r in res if r.ok and r.ttft is not None]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    refused: dict[str, int] = {}
    for r in res:
        if not r.ok:
            refused[r.error] = refused.get(r.error, 0) + 1
    lost = sum(n for e, n in refused.items() if e not in ("HTTP 429", "HTTP 503"))
    return [label, tenant, len(res), f"{sum(x <= sla for x in ttft) / max(1, len(res)) * 100:.1f}%",
            f"{nearest_rank(ttft, 0.95):.2f}", ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "0", lost]


async def run(a: argparse.Namespace, work: Path, label: str, flow: bool, b: list[TraceRecord],
              aggr: list[TraceRecord]) -> list[list[Any]]:
    sims, mi, _ = start_sims(a, work, label.replace(" ", "_"))
    procs: list[Proc] = []
    try:
        path = work / f"gw-{'flow' if flow else 'none'}.yaml"
        path.write_text(yaml.safe_dump(gateway_config(a, mi, f"redis://127.0.0.1:{a.redis_port}/0", flow,
                                                      f"flow{int(flow)}:")))
        urls = []
        for i in range(2):
            port = a.port + 2 * i
            procs.append(Proc(f"gateway-{i}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
                                               "--port", str(port)], f"http://127.0.0.1:{port}/healthz",
                              log=work / f"gw-{label.replace(' ', '_')}-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}/v1")
        for p in procs:
            p.wait_ready(120)
        if a.split:  # each tenant on its own instance: the shared tags alone carry the other's service
            rb, ra = await asyncio.gather(run_http(b, urls[0], MODEL, KEYS["B"], a.time_scale, a.concurrency),
                                          run_http(aggr, urls[1], MODEL, KEYS["A"], a.time_scale, a.concurrency))
        else:  # a load balancer's spread: every other request of each tenant to each instance
            parts = await asyncio.gather(*(run_http(tr[i::2], urls[i], MODEL, KEYS[t], a.time_scale, a.concurrency)
                                           for t, tr in (("B", b), ("A", aggr)) for i in (0, 1)))
            rb, ra = parts[0] + parts[1], parts[2] + parts[3]
    finally:
        for p in procs + sims:
            p.stop()
    for r in rb + ra:  # wall seconds -> simulated seconds
        r.ttft = None if r.ttft is None else r.ttft * a.time_scale
    return [tenant_row(label, "B", rb, a.sla), tenant_row(label, "A", ra, a.sla)]


async def main_async(a: argparse.Namespace) -> None:
    victim, aggressor = read_trace(a.victim), read_trace(a.aggressor)
    fc = FlowControl()
    b = mix([Part(victim, 1, a.victim_speed)], a.window_s)
    b_demand = demand(b, fc, a.window_s)
    speed = a.aggressor_x * b_demand / demand(aggressor, fc)
    aggr = mix([Part(aggressor, 2, speed)], a.window_s)
    work = Path(tempfile.mkdtemp(prefix="gw-flow-http-"))
    redis = redis_proc(a.redis_port, work)
    await asyncio.sleep(0.5)
    rows: list[list[Any]] = []
    try:
        for label, flow in (("no flow control", False), ("flow control", True)):
            rows += await run(a, work, label, flow, b, aggr)
            print(f"  {label}: done (logs in {work})", file=sys.stderr, flush=True)
    finally:
        redis.stop()
    print(f"\nnoisy neighbour over HTTP: {2 * a.nodes} MI355X TP4 ranks, time scale {a.time_scale:g}, first "
          f"{a.window_s:.0f} s; B = {a.victim} ({len(b)} requests), A = {a.aggressor} at "
          f"{a.aggressor_x:g}x B's demand (speed {speed:.2f}, {len(aggr)} requests), "
          f"{'B on instance 1 and A on instance 2' if a.split else 'each spread over two instances'}, one Redis; "
          f"TTFT in simulated s, SLA {a.sla} s; engines {'' if a.priority_scheduling else 'not '}scheduling by "
          f"priority, flow.under_share_priority "
          f"{a.under_share_priority if a.under_share_priority is not None else FlowControl().under_share_priority}")
    print(table(["run", "tenant", "requests", "within SLA", "TTFT p95", "refused / failed", "lost"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--victim", required=True)
    p.add_argument("--aggressor", required=True)
    p.add_argument("--aggressor-x", type=float, default=5.0)
    p.add_argument("--victim-speed", type=float, default=1.0, help="B's arrivals compressed this many times (0.5 on "
                   "2 nodes keeps B at its share of a fleet half the size of the 4-node default)")
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--kv-capacity", type=int, default=None)
    p.add_argument("--b200-replicas", type=int, default=0)
    p.add_argument("--sla", type=float, default=2.22)
    p.add_argument("--concurrency", type=int, default=1024)
    p.add_argument("--split", action="store_true", help="B only on the first instance, A only on the second (the "
                   "default spreads each tenant over both, as a load balancer would)")
    p.add_argument("--priority-scheduling", action="store_true", help="the simulated servers schedule by priority "
                   "(--enable-priority-scheduling, as deploy/sglang/ and the virtual-clock fleet run them): the "
                   "gateway then sends each request's priority, flow control's raise included")
    p.add_argument("--under-share-priority", type=int, default=None, help="flow.under_share_priority (default: the "
                   "config's default)")
    p.add_argument("--sim-port", type=int, default=24100)
    p.add_argument("--port", type=int, default=24300)
    p.add_argument("--redis-port", type=int, default=24390)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
