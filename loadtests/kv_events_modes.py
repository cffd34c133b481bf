"""routing.mode approximate vs precise vs hybrid: the same simulated fleet, the same arrivals.

    .venv/bin/python -m loadtests.kv_events_modes --repeat 2                          # ~7 minutes on 2 cores
    .venv/bin/python -m loadtests.kv_events_modes --scenarios evicting --instances 2 --repeat 2
    .venv/bin/python -m loadtests.kv_events_modes --scenarios cotenant,bystander --repeat 2

Each (scenario, mode) runs on a fleet of its own: a fresh `gateway sim` (R replicas, KV events on, `--kv-capacity`
per replica) and fresh gateways in front of it, then the seeded Wafer workload (a shared prefix per group + fresh
text: the same groups in the same order at the same times) is sent open-loop. `--repeat N` runs every mode N times,
the order rotated each time, and the table shows the means (with each run's hit rate).
Scenarios: `evicting` (the groups' prefixes exceed the fleet's KV: evictions decide), `fitting` (they fit),
`bystander` (a second client sends its own prompts straight to the replicas: evictions the gateway does not see),
`cotenant` (a second client sends the tenant's own groups, with its cache_salt, straight to the replicas: it
evicts and warms prefixes the gateway does not see), `trace` (the Mooncake conversation trace over HTTP).
Figures: prompt-token hit rate (the engines' cached_tokens), TTFT p50/p95 and the share within the SLA (simulated
seconds), index corrections (engine reported fewer cached tokens than the gateway predicted), predicted vs reported
cached tokens, the event views against the engines' pages (sampled during the run, and settled after it), and the
precise index's answers by source. `--instances N`: N gateways per mode, each with its own in-memory index (clients
alternate). Writes loadtests/out/kv_events_modes_<scenarios>_x<N>.json (every request's group, replica, cached
tokens, TTFT and route, for analysis).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from tqdm import tqdm

from gateway.config import hash_key
from gateway.recording.trace import read_trace
from gateway_lab.replay.http import run_http
from gateway_lab.replay.http import summary as trace_summary
from loadtests.fleet_http import MI355X_PRICE, MI355X_TIMING, wall_timing
from loadtests.procs import Proc
from loadtests.prom import gateway_metrics_text, total
from loadtests.runner import run_rate, summarize
from loadtests.workload import WaferWorkload

KEY = "sk-kv-modes"
TENANT = "bench"
SERVED = "zai-org/GLM-5.2"  # the simulator's served model name (the bystander calls the replicas directly)
MODES = ("approximate", "precise", "hybrid")
OUT = Path(__file__).parent / "out" / "kv_events_modes.json"


class SameTenant(WaferWorkload):
    """The Wafer workload as the gateway forwards it for the bench tenant (its cache_salt), sent straight to the
    replicas round-robin."""

    def body(self, group: int, max_tokens: int | None = None) -> dict[str, Any]:
        return {**super().body(group, max_tokens), "cache_salt": f"tenant:{TENANT}"}


def start_fleet(a: argparse.Namespace, work: Path, kv_capacity: int, tag: str) -> tuple[Proc, list[str]]:
    kv = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{a.kv_port}",  # loopback only
                     "replay_endpoint": f"tcp://127.0.0.1:{a.kv_port + 50}"})
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
           "tenants": [{"name": TENANT, "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "routing": {"mode": mode, "ttft_sla_ms": a.sla * 1000 / ts,
                       "policy": {"type": "prefix_sla_cost", "stickiness_penalty_ms": 1000 / ts},
                       "kv_events": {"block_size": 64, "discovery_interval_s": 1.0, "speculative_s": a.speculative_s}},
           "observability": {"log_requests": False}, "timeouts": {"first_byte": 600, "total": 3000, "idle": 120}}
    path = work / f"gw-{mode}-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Proc(f"gateway-{mode}-{port}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port",
                                          str(port)], f"http://127.0.0.1:{port}/healthz", log=work / f"gw-{mode}-{port}.log")


async def evicted_pages(c: httpx.AsyncClient, sims: list[str]) -> int:
    total = 0
    for s in sims:
        total += sum(rk["evicted_pages"] for rk in (await c.get(f"{s}/_sim/state")).json()["ranks"])
    return total


async def view_vs_engine(c: httpx.AsyncClient, urls: list[str], sims: list[str]) -> tuple[int, int] | None:
    """Pages the engines hold that the event views lack, and pages the views hold that the engines do not, summed
    over ranks and gateway instances (None in approximate mode: no views). Compared by count per rank: an unreported
    store shows as missing, an unreported eviction as extra."""
    engine: list[int] = []
    for s in sims:
        engine += [rk["cache_pages"] for rk in (await c.get(f"{s}/_sim/state")).json()["ranks"]]
    missing = extra = 0
    for u in urls:
        kv = (await c.get(u.removesuffix("/v1") + "/readyz")).json().get("kv_events")
        if not kv:
            return None
        views = [sub["blocks"] for _, sub in sorted(kv["subscriptions"].items())]
        for v, e in zip(views, engine, strict=False):
            missing += max(0, e - v)
            extra += max(0, v - e)
    return missing, extra


async def watch_views(urls: list[str], sims: list[str], out: list[tuple[int, int]]) -> None:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(httpx.HTTPError):
                got = await view_vs_engine(c, urls, sims)
                if got is None:
                    return
                out.append(got)


async def run_mode(a: argparse.Namespace, urls: list[str], sims: list[str], wl_args: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for s in sims:
            r = await c.post(f"{s}/flush_cache")
            if r.status_code != 200:
                raise RuntimeError(f"{s}: flush refused ({r.status_code}): engines busy")
        await asyncio.sleep(1.5)  # the flush's AllBlocksCleared reaches every subscriber
        before = await gateway_metrics_text(c, urls)
        evicted_before = await evicted_pages(c, sims)
    wl = WaferWorkload(**wl_args)
    samples: list[tuple[int, int]] = []
    watch = asyncio.create_task(watch_views(urls, sims, samples))
    try:
        res = await run_rate(urls, a.rate, a.duration, wl, api_key=KEY, time_scale=a.time_scale, seed=a.seed,
                             progress=not a.no_progress)  # the runner's bar (simulated seconds sent) under the run's
    finally:
        watch.cancel()
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        after = await gateway_metrics_text(c, urls)
        evicted = await evicted_pages(c, sims) - evicted_before
        await asyncio.sleep(1.0)  # the last batches arrive
        settled = await view_vs_engine(c, urls, sims)

    def delta(name: str, labels: str = "") -> float:
        return total(after, name, labels) - total(before, name, labels)

    s = summarize(res, a.rate)
    s["sla_met"] = sum(1 for r in res if r.ok and r.ttft is not None and r.ttft <= a.sla) / max(len(res), 1)
    s["index_corrections"] = delta("gateway_prefix_index_corrections")
    s["answers_events"] = delta("gateway_kv_events_index_answers", 'source="events"')
    s["answers_fallback"] = delta("gateway_kv_events_index_answers", 'source="fallback"')
    s["evicted_pages"] = evicted
    s["tokenize_s_per_req"] = delta("gateway_request_tokenize_seconds") / max(len(res), 1)
    if samples:  # while the load ran: the event views' pages against the engines' (sampled once a second)
        s["view_pages_missing"] = sum(m for m, _ in samples) / len(samples)
        s["view_pages_extra"] = sum(x for _, x in samples) / len(samples)
    if settled is not None:
        s["view_settled_missing"], s["view_settled_extra"] = settled
    s["cached_predicted"] = delta("gateway_cached_tokens_predicted")
    s["cached_reported"] = delta("gateway_cached_tokens_reported")
    s["requests_log"] = [[round(r.sent, 3), r.group, r.headers.get("x-gateway-replica", ""), r.prompt_tokens,
                          r.cached_tokens, r.ttft, r.headers.get("x-gateway-route", "")] for r in res]
    return s


async def run_trace_mode(a: argparse.Namespace, urls: list[str], sims: list[str]) -> dict[str, Any]:
    """The Mooncake conversation trace through `gateway replay --http`'s client (prompts rebuilt from the block ids),
    sent at trace time / time scale, so simulated time follows the trace."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for s in sims:
            if (await c.post(f"{s}/flush_cache")).status_code != 200:
                raise RuntimeError(f"{s}: flush refused: engines busy")
        await asyncio.sleep(1.5)
        before = await gateway_metrics_text(c, urls)
    trace = read_trace(a.trace, a.trace_limit)
    # per finished request, as fleet_trace's bar; under the run's
    with tqdm(total=len(trace), desc="trace", unit="req", file=sys.stderr, leave=False, disable=a.no_progress) as bar:
        results = await run_http(trace, urls[0], "glm-5.2", KEY, a.time_scale, 256,
                                 progress=None if a.no_progress else bar.update)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        after = await gateway_metrics_text(c, urls)
    out = trace_summary(results, a.sla / a.time_scale)  # TTFTs here are wall seconds
    for k in ("ttft_p50", "ttft_p95", "ttft_p99"):
        out[k] *= a.time_scale
    out["success"] = out["ok"] / max(out["requests"], 1)
    out["cache_hit"], out["sla_met"] = out.pop("hit_rate"), out.pop("within_sla")
    out["index_corrections"] = total(after, "gateway_prefix_index_corrections") - \
        total(before, "gateway_prefix_index_corrections")
    return out


async def run_one(a: argparse.Namespace, work: Path, scen: str, cap: int, mode: str,
                  wl_args: dict[str, Any]) -> dict[str, Any]:
    """One mode on a fleet of its own: a fresh `gateway sim` and fresh gateways, so no mode inherits another's
    process state (an earlier layout ran the modes in turn on one sim, always in the same order)."""
    sim, sims = start_fleet(a, work, cap, f"{scen}-{mode}")
    ports = [a.port + 2 * j for j in range(a.instances)]  # `instances` gateways, own in-memory index each, clients alternate
    gws = [start_gateway(a, work, mode, sims, port) for port in ports]
    try:
        for g in gws:
            g.wait_ready(120)
        await asyncio.sleep(2.5)  # discovery and subscriptions
        urls = [f"http://127.0.0.1:{p}/v1" for p in ports]
        if scen == "trace":
            return await run_trace_mode(a, urls, sims)
        by = None
        if scen in ("bystander", "cotenant"):  # a second client on the same replicas, around the gateway
            if scen == "bystander":  # its own prefixes, its own namespace: it only evicts
                by_wl = WaferWorkload(**{**wl_args, "seed": a.seed + 1000, "groups": a.bystander_groups}, model=SERVED)
            else:  # the tenant's own prefixes and cache namespace (another router, a batch job): it evicts and warms
                by_wl = SameTenant(**wl_args, model=SERVED)
                by_wl._rng = np.random.default_rng(a.seed + 1000)  # the same groups, other fresh text and order
            by = asyncio.create_task(run_rate([f"{u}/v1" for u in sims], a.bystander_rate, a.duration, by_wl,
                                              time_scale=a.time_scale, seed=a.seed + 1000, progress=False))
        r = await run_mode(a, urls, sims, wl_args)
        if by is not None:
            others = await by
            r["bystander"] = {"requests": len(others), "ok": sum(x.ok for x in others)}
        return r
    finally:
        for p in [*gws, sim]:
            p.stop()


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-kvmodes-"))
    caps = {"evicting": a.kv_capacity_small, "fitting": a.kv_capacity_large, "trace": a.kv_capacity_trace,
            "bystander": a.kv_capacity_small, "cotenant": a.kv_capacity_small}
    scenarios = {k: caps[k] for k in a.scenarios.split(",")}
    wl_args = {"groups": a.groups, "prefix_tokens": a.prefix_tokens, "prompt_tokens": a.prompt_tokens,
               "output_tokens": a.output_tokens, "seed": a.seed}
    modes = a.modes.split(",")
    out: dict[str, Any] = {"args": vars(a), "scenarios": {}}
    # one step per (scenario, repeat, mode) run, drawn between runs; the runner's bar under it advances with the
    # arrivals (the bystander's runs without one)
    tqdm.monitor_interval = 0  # no tqdm monitor thread waking in the measuring client
    bar = tqdm(total=len(scenarios) * a.repeat * len(modes), unit="run", file=sys.stderr, leave=False,
               disable=a.no_progress)
    for scen, cap in scenarios.items():
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for rep in range(a.repeat):
            order = modes[rep % len(modes):] + modes[: rep % len(modes)]  # rotated: no mode always runs first
            for m in order:
                bar.set_description(f"{scen} {m} ({rep + 1}/{a.repeat})")
                r = await run_one(a, work, scen, cap, m, wl_args)
                for k in ("evicted_pages", "answers_events", "answers_fallback"):
                    r.setdefault(k, 0)
                runs[m].append(r)
                tqdm.write(f"{scen:9s} {m:11s} hit {r['cache_hit']:.3f}  p50 {r['ttft_p50']:.2f} s  p95 {r['ttft_p95']:.2f} s  "
                           f"SLA {r['sla_met']:.3f}  ok {r['success']:.3f}  corrections {r['index_corrections']:.0f}  "
                           f"evicted {r['evicted_pages']}  view missing/extra {r.get('view_pages_missing', 0):.1f}/"
                           f"{r.get('view_pages_extra', 0):.1f} settled {r.get('view_settled_missing', '-')}/"
                           f"{r.get('view_settled_extra', '-')}  predicted/reported {r.get('cached_predicted', 0):.0f}/"
                           f"{r.get('cached_reported', 0):.0f}  answers events/fallback {r['answers_events']:.0f}/"
                           f"{r['answers_fallback']:.0f}", file=sys.stderr)
                bar.update()
        out["scenarios"][scen] = {"kv_capacity_per_replica": cap, "runs": runs,
                                  "rows": {m: mean_row(rs) for m, rs in runs.items()}}
    bar.close()
    OUT.parent.mkdir(exist_ok=True)
    out_path = OUT.with_name(f"kv_events_modes_{'_'.join(scenarios)}_x{a.instances}.json")
    out_path.write_text(json.dumps(out, indent=1, default=str))
    print(table(out, a.instances))


FIELDS = ("cache_hit", "ttft_p50", "ttft_p95", "sla_met", "index_corrections", "success")


def mean_row(rs: list[dict[str, Any]]) -> dict[str, Any]:
    row = {k: sum(r[k] for r in rs) / len(rs) for k in FIELDS}
    row["hits"] = [round(r["cache_hit"], 3) for r in rs]
    return row


def table(out: dict[str, Any], instances: int) -> str:
    lines = ["| instances | scenario | mode | hit rate (mean) | per run | TTFT p50 (s) | TTFT p95 (s) | within SLA | "
             "index corrections | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for scen, d in out["scenarios"].items():
        for m, r in d["rows"].items():
            lines.append(f"| {instances} | {scen} | {m} | {r['cache_hit']:.3f} | {' / '.join(f'{h:.3f}' for h in r['hits'])} "
                         f"| {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {r['sla_met']:.3f} | "
                         f"{r['index_corrections']:.0f} | {r['success']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="evicting,fitting", help="evicting, fitting, bystander, "
                   "cotenant, trace (comma-separated)")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode (the order rotates); the table shows means")
    p.add_argument("--bystander-rate", type=float, default=1.0, help="bystander scenario: requests per simulated "
                   "second a second client sends straight to the replicas (its own groups, no cache_salt)")
    p.add_argument("--bystander-groups", type=int, default=48)
    p.add_argument("--modes", default=",".join(MODES), help="routing.mode per gateway, in this order")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stderr)")
    a = p.parse_args()
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
