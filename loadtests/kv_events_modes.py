"""routing.mode approximate vs precise vs hybrid: the same simulated fleet, the same arrivals, one run.

    .venv/bin/python -m loadtests.kv_events_modes                     # ~3 minutes on 2 cores
    .venv/bin/python -m loadtests.kv_events_modes --instances 2       # two gateway instances per mode

One `gateway sim` process (R replicas, KV events on, `--kv-capacity` per replica) and three gateways in front of it,
one per mode (each started idle, so its approximate index starts empty). For each scenario the three modes run in
turn on the same fleet: every engine's cache is flushed first (/flush_cache), then the Wafer workload (a shared
prefix per group + fresh text, seeded: the same groups in the same order at the same times) is sent open-loop.
Scenarios: `evicting` (the groups' prefixes exceed the fleet's KV: evictions decide) and `fitting` (they fit).
Figures: prompt-token hit rate (the engines' cached_tokens), TTFT p50/p95 and the share within the SLA (simulated
seconds), index corrections (engine reported fewer cached tokens than the gateway predicted), and the precise
index's answers by source. `--instances N`: N gateways per mode, each with its own in-memory index (clients
alternate). Writes loadtests/out/kv_events_modes_<scenarios>_x<N>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from gateway.replay.http import run_http
from gateway.replay.http import summary as trace_summary
from gateway.replay.trace import read_trace
from loadtests.fleet_http import MI355X_PRICE, MI355X_TIMING, wall_timing
from loadtests.procs import Proc
from loadtests.runner import run_rate, summarize
from loadtests.workload import WaferWorkload

KEY = "sk-kv-modes"
MODES = ("approximate", "precise", "hybrid")
OUT = Path(__file__).parent / "out" / "kv_events_modes.json"


def start_fleet(a: argparse.Namespace, work: Path, kv_capacity: int, tag: str) -> tuple[Proc, list[str]]:
    kv = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{a.kv_port}", "replay_endpoint": f"tcp://*:{a.kv_port + 50}"})
    p = Proc(f"sim-{tag}", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", str(a.replicas),
                            "--port", str(a.sim_port), "--time-scale", str(a.time_scale), "--jitter", "0",
                            "--kv-capacity", str(kv_capacity), "--kv-events-config", kv],
             f"http://127.0.0.1:{a.sim_port}/ping", log=work / f"sim-{tag}.log")
    p.wait_ready()
    return p, [f"http://127.0.0.1:{a.sim_port + i}" for i in range(a.replicas)]


def start_gateway(a: argparse.Namespace, work: Path, mode: str, sims: list[str], port: int) -> Proc:
    ts = a.time_scale
    cfg = {"models": [{"name": "glm-5.2", "pools": ["mi355x"]}],
           "pools": [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2", "pricing": MI355X_PRICE,
                      "timing": wall_timing(MI355X_TIMING, ts),
                      "replicas": [{"name": f"mi355x-{i}", "url": u} for i, u in enumerate(sims)]}],
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "routing": {"mode": mode, "ttft_sla_ms": a.sla * 1000 / ts, "stickiness_penalty_ms": 1000 / ts,
                       "kv_events": {"block_size": 64, "discovery_interval_s": 1.0, "speculative_s": a.speculative_s}},
           "observability": {"log_requests": False}, "timeouts": {"first_byte": 600, "total": 3000, "idle": 120}}
    path = work / f"gw-{mode}-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Proc(f"gateway-{mode}-{port}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port",
                                          str(port)], f"http://127.0.0.1:{port}/healthz", log=work / f"gw-{mode}-{port}.log")


def counter(text: str, name: str, labels: str = "") -> float:
    """Sum of a counter's samples (`name` without _total; its _created samples are not counts)."""
    total = 0.0
    for line in text.splitlines():
        series = line.split("{", 1)[0].split(" ", 1)[0]
        if series in (name, f"{name}_total") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def evicted_pages(c: httpx.AsyncClient, sims: list[str]) -> int:
    total = 0
    for s in sims:
        total += sum(rk["evicted_pages"] for rk in (await c.get(f"{s}/_sim/state")).json()["ranks"])
    return total


async def metrics_text(c: httpx.AsyncClient, urls: list[str]) -> list[str]:
    return [(await c.get(u.removesuffix("/v1") + "/metrics")).text for u in urls]


def total(texts: list[str], name: str, labels: str = "") -> float:
    return sum(counter(t, name, labels) for t in texts)


async def run_mode(a: argparse.Namespace, urls: list[str], sims: list[str], wl_args: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for s in sims:
            r = await c.post(f"{s}/flush_cache")
            if r.status_code != 200:
                raise RuntimeError(f"{s}: flush refused ({r.status_code}): engines busy")
        await asyncio.sleep(1.5)  # the flush's AllBlocksCleared reaches every subscriber
        before = await metrics_text(c, urls)
        evicted_before = await evicted_pages(c, sims)
    wl = WaferWorkload(**wl_args)
    res = await run_rate(urls, a.rate, a.duration, wl, api_key=KEY, time_scale=a.time_scale, seed=a.seed, progress=False)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        after = await metrics_text(c, urls)
        evicted = await evicted_pages(c, sims) - evicted_before

    def delta(name: str, labels: str = "") -> float:
        return total(after, name, labels) - total(before, name, labels)

    s = summarize(res, a.rate)
    s["sla_met"] = sum(1 for r in res if r.ok and r.ttft is not None and r.ttft <= a.sla) / max(len(res), 1)
    s["index_corrections"] = delta("gateway_prefix_index_corrections")
    s["answers_events"] = delta("gateway_kv_events_index_answers", 'source="events"')
    s["answers_fallback"] = delta("gateway_kv_events_index_answers", 'source="fallback"')
    s["evicted_pages"] = evicted
    s["tokenize_s_per_req"] = delta("gateway_request_tokenize_seconds") / max(len(res), 1)
    return s


async def run_trace_mode(a: argparse.Namespace, urls: list[str], sims: list[str]) -> dict[str, Any]:
    """The Mooncake conversation trace through `gateway replay --http`'s client (prompts rebuilt from the block ids),
    sent at trace time / time scale, so simulated time follows the trace."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for s in sims:
            if (await c.post(f"{s}/flush_cache")).status_code != 200:
                raise RuntimeError(f"{s}: flush refused: engines busy")
        await asyncio.sleep(1.5)
        before = await metrics_text(c, urls)
    trace = read_trace(a.trace, a.trace_limit)
    results = await run_http(trace, urls[0], "glm-5.2", KEY, a.time_scale, 256)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        after = await metrics_text(c, urls)
    out = trace_summary(results, a.sla / a.time_scale)  # TTFTs here are wall seconds
    for k in ("ttft_p50", "ttft_p95", "ttft_p99"):
        out[k] *= a.time_scale
    out["success"] = out["ok"] / max(out["requests"], 1)
    out["cache_hit"], out["sla_met"] = out.pop("hit_rate"), out.pop("within_sla")
    out["index_corrections"] = total(after, "gateway_prefix_index_corrections") - \
        total(before, "gateway_prefix_index_corrections")
    return out


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-kvmodes-"))
    caps = {"evicting": a.kv_capacity_small, "fitting": a.kv_capacity_large, "trace": a.kv_capacity_trace}
    scenarios = {k: caps[k] for k in a.scenarios.split(",")}
    wl_args = {"groups": a.groups, "prefix_tokens": a.prefix_tokens, "prompt_tokens": a.prompt_tokens,
               "output_tokens": a.output_tokens, "seed": a.seed}
    out: dict[str, Any] = {"args": vars(a), "scenarios": {}}
    for scen, cap in scenarios.items():
        sim, sims = start_fleet(a, work, cap, scen)
        # per mode, `instances` gateways with their own in-memory index (no Redis), clients alternating
        ports = {m: [a.port + 10 * i + j for j in range(a.instances)] for i, m in enumerate(MODES)}
        gws = [start_gateway(a, work, m, sims, port) for m in MODES for port in ports[m]]
        try:
            for g in gws:
                g.wait_ready(120)
            await asyncio.sleep(2.5)  # discovery and subscriptions
            rows = {}
            for m in MODES:
                urls = [f"http://127.0.0.1:{p}/v1" for p in ports[m]]
                r = rows[m] = await (run_trace_mode(a, urls, sims) if scen == "trace" else run_mode(a, urls, sims, wl_args))
                r.setdefault("evicted_pages", 0)
                r.setdefault("answers_events", 0)
                r.setdefault("answers_fallback", 0)
                print(f"{scen:9s} {m:11s} hit {r['cache_hit']:.3f}  p50 {r['ttft_p50']:.2f} s  p95 {r['ttft_p95']:.2f} s  "
                      f"SLA {r['sla_met']:.3f}  ok {r['success']:.3f}  corrections {r['index_corrections']:.0f}  "
                      f"evicted {r['evicted_pages']}  answers events/fallback {r['answers_events']:.0f}/{r['answers_fallback']:.0f}", file=sys.stderr, flush=True)
            out["scenarios"][scen] = {"kv_capacity_per_replica": cap, "rows": rows}
        finally:
            for p in [*gws, sim]:
                p.stop()
    OUT.parent.mkdir(exist_ok=True)
    out_path = OUT.with_name(f"kv_events_modes_{'_'.join(scenarios)}_x{a.instances}.json")
    out_path.write_text(json.dumps(out, indent=1, default=str))
    print(table(out))


def table(out: dict[str, Any]) -> str:
    lines = ["| scenario | mode | hit rate | TTFT p50 (s) | TTFT p95 (s) | within SLA | index corrections | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for scen, d in out["scenarios"].items():
        for m, r in d["rows"].items():
            lines.append(f"| {scen} | {m} | {r['cache_hit']:.3f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | "
                         f"{r['sla_met']:.3f} | {r['index_corrections']:.0f} | {r['success']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="evicting,fitting", help="evicting, fitting, trace (comma-separated)")
    p.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    p.add_argument("--trace-limit", type=int, default=1200, help="the trace's first N requests")
    p.add_argument("--kv-capacity-trace", type=int, default=200_000, help="per replica, tokens (trace scenario)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--instances", type=int, default=1, help="gateway instances per mode (own in-memory index each)")
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--prefix-tokens", type=int, default=8000)
    p.add_argument("--prompt-tokens", type=int, default=10000)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--kv-capacity-small", type=int, default=60_000, help="per replica, tokens (evicting scenario)")
    p.add_argument("--kv-capacity-large", type=int, default=2_400_000, help="per replica, tokens (fitting scenario)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per simulated second")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds per mode")
    p.add_argument("--time-scale", type=float, default=6.0)
    p.add_argument("--sla", type=float, default=2.22, help="TTFT SLA, simulated seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--speculative-s", type=float, default=2.0, help="routing.kv_events.speculative_s (wall seconds)")
    p.add_argument("--sim-port", type=int, default=31400)
    p.add_argument("--kv-port", type=int, default=32400)
    p.add_argument("--port", type=int, default=31300)
    a = p.parse_args()
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
