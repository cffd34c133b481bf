"""The fleet over HTTP on a slice of a Mooncake trace: every target in turn gets the same fresh simulated replicas
(cold caches) and the same slice, replayed open-loop by `gateway replay --http`'s client, in one run.

    .venv/bin/python -m loadtests.fleet_trace --trace /work/shared/traces/conversation_trace.jsonl \\
        --slice-start-s 0 --slice-s 1200 --time-scale 12 --nodes 2

Prompts are the replay's deterministic blocks (shared hash_ids share text; gateway_lab.replay.http). The simulators run
`--time-scale` times faster than real time and the slice's arrivals are compressed by the same factor, so the fleet
sees the trace's load; TTFT and send lag are reported in simulated seconds (wall x time scale), which also scales each
router's own wall-clock overhead by the same factor. Hit rate is token-weighted from the simulators' own counters
(sglang:cached_tokens_total / prompt_tokens_total), the same for every target (LiteLLM relays no cached_tokens).
Router CPU per request: utime + stime of the router's processes (procfs) over the replay, / requests.
Targets are fleet_http's (same launch code, `fleet_http.start_router`); "SGLang router round_robin" is the peer's
round-robin. Prints a table, writes loadtests/out/<out>.json and a PNG (`--png`, default loadtests/out/<out>.png).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from gateway.recording.trace import TraceRecord, read_trace
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate
from gateway_lab.replay.http import HttpResult, run_http, summary
from gateway_lab.sim.profiles import SCHEDULE_POLICIES, SHORTEST_PREFILL_FIRST
from loadtests.fleet_http import KEY, engine_tokens, redis_proc, start_router, start_sims
from loadtests.procs import Proc, cpu_seconds
from loadtests.report import OUT, plot_trace_targets, save_json, table

MODEL = "glm-5.2"
KV_TOKENS = 2_400_000  # an MI355X TP4 rank (the simulator's profile)


def trace_slice(trace: list[TraceRecord], start_s: float, length_s: float) -> list[TraceRecord]:
    """The requests arriving in [start, start + length) seconds, their timestamps moved to start at 0."""
    lo, hi = start_s * 1000, (start_s + length_s) * 1000
    return [TraceRecord(r.timestamp_ms - lo, r.input_length, r.output_length, r.hash_ids, r.tenant)
            for r in trace if lo <= r.timestamp_ms < hi]


async def warm_up(base: str, tries: int = 60) -> None:
    """Two tiny requests that share no block with the trace, until both succeed: a peer may answer 503 until its
    workers are registered, and a proxy's first request pays its lazy imports."""
    probe = [TraceRecord(0.0, 8, 1, (-1,)), TraceRecord(0.0, 8, 1, (-2,))]
    for _ in range(tries):
        res = await run_http(probe, base, MODEL, KEY, 1.0, 2)
        if all(r.ok for r in res):
            return
        await asyncio.sleep(1)
    raise RuntimeError(f"{base}: warm-up requests failed: {[r.error for r in res]}")


async def run_target(a: argparse.Namespace, work: Path, name: str, redis_url: str,
                     sl: list[TraceRecord]) -> dict[str, Any] | None:
    sims, mi, _ = start_sims(a, work, re.sub(r"[^A-Za-z0-9]+", "_", name))
    procs: list[Proc] = []
    try:
        procs, urls = start_router(a, work, name, mi, [], redis_url)
        if not procs:
            print(f"  {name}: not available here", file=sys.stderr)
            return None
        for p in procs:
            p.wait_ready(300)
        await warm_up(urls[0])
        # the router's own background (its polls of the engines, heartbeats, timers) with no request in flight:
        # what of the CPU column it pays whatever the traffic
        idle_s = getattr(a, "idle_s", 0.0)
        idle = 0.0
        if idle_s:
            c0 = sum(cpu_seconds(p.pid) for p in procs)
            await asyncio.sleep(idle_s)
            idle = (sum(cpu_seconds(p.pid) for p in procs) - c0) / idle_s
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            before = await engine_tokens(c, mi)
        # the bar lives in this client process (router CPU below is the routers' processes); opened and closed
        # outside the timed span
        with tqdm(total=len(sl), desc=name, unit="req", file=sys.stderr, leave=False, disable=a.no_progress) as bar:
            cpu0, t0 = sum(cpu_seconds(p.pid) for p in procs), time.perf_counter()
            res = await run_http(sl, urls[0], MODEL, KEY, a.time_scale, a.concurrency,
                                 progress=None if a.no_progress else bar.update)
            wall, cpu = time.perf_counter() - t0, sum(cpu_seconds(p.pid) for p in procs) - cpu0
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            after = await engine_tokens(c, mi)
    finally:
        for p in procs + sims:
            p.stop()
    for r in res:  # wall seconds -> simulated seconds
        r.ttft = None if r.ttft is None else r.ttft * a.time_scale
        r.lag *= a.time_scale
    s: dict[str, Any] = summary(res, a.sla)
    s["failed"] = s["requests"] - s["ok"]
    s["hit_usage"] = s.pop("hit_rate")
    s["engine_hit"] = (after[1] - before[1]) / max(after[0] - before[0], 1.0)
    s["cpu_ms_per_req"] = cpu / max(len(res), 1) * 1000
    if idle_s:
        s["idle_cpu_ms_per_s"] = idle * 1000
        s["idle_ms_per_req"] = idle * wall / max(len(res), 1) * 1000  # the idle rate over the replay's wall time
    s["wall_s"] = wall
    s["errors"] = _errors(res)
    s["load_avg"] = os.getloadavg()
    s["ttfts"] = sorted(r.ttft for r in res if r.ok and r.ttft is not None)
    print(f"  {name}: {s['ok']}/{s['requests']} ok, hit {s['engine_hit'] * 100:.1f}%, TTFT p50 {s['ttft_p50']:.2f} "
          f"p95 {s['ttft_p95']:.2f} s, {s['within_sla'] * 100:.1f}% within SLA, {wall:.0f} s wall",
          file=sys.stderr, flush=True)
    return s


def _errors(res: list[HttpResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in res:
        if not r.ok:
            out[r.error] = out.get(r.error, 0) + 1
    return out


def the_slice(a: argparse.Namespace) -> list[TraceRecord]:
    """The slice `fleet_args` names, at most `--limit` of it; exits when it is empty."""
    sl = trace_slice(read_trace(a.trace), a.slice_start_s, a.slice_s)
    if a.limit:
        sl = sl[: a.limit]
    if not sl:
        raise SystemExit(f"no requests in [{a.slice_start_s}, {a.slice_start_s + a.slice_s}) s of {a.trace}")
    return sl


async def main_async(a: argparse.Namespace) -> None:
    sl = the_slice(a)
    kv = (a.kv_capacity or KV_TOKENS) * 2 * a.nodes
    bounds = {"ideal": ideal_hit_rate(sl), "lru": lru_hit_rate(sl, kv)}
    work = Path(tempfile.mkdtemp(prefix="gw-fleet-trace-"))
    redis = redis_proc(a.redis_port, work)
    await asyncio.sleep(0.5)
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in (n.strip() for n in a.targets.split(",")):
            try:
                s = await run_target(a, work, name, f"redis://127.0.0.1:{a.redis_port}/0", sl)
            except RuntimeError as e:  # a peer that does not start here is reported, not the end of the run
                print(f"  {name}: {e} (logs in {work})", file=sys.stderr, flush=True)
                s = None
            if s is not None:
                results[name] = s
            save_json(a.out, {"args": vars(a), "bounds": bounds, "results": results})  # a crash loses nothing
    finally:
        redis.stop()
    span = (sl[-1].timestamp_ms - sl[0].timestamp_ms) / 1000
    head = (f"{a.trace} [{a.slice_start_s:g}, {a.slice_start_s + a.slice_s:g}) s: {len(sl)} requests over {span:.0f} s, "
            f"{sum(r.input_length for r in sl) / 1e6:.1f}M prompt tokens; {2 * a.nodes} MI355X TP4 ranks "
            f"({kv / 1e6:.1f}M KV tokens in all), time scale {a.time_scale:g}; ideal hit {bounds['ideal'] * 100:.1f}%, "
            f"LRU bound {bounds['lru'] * 100:.1f}%; TTFT in simulated s, SLA {a.sla} s")
    rows = [[name, s["requests"], s["ok"], s["failed"], f"{s['engine_hit'] * 100:.1f}%",
             f"{s['engine_hit'] / bounds['lru'] * 100:.0f}%" if bounds["lru"] else "-", f"{s['ttft_p50']:.2f}",
             f"{s['ttft_p95']:.2f}", f"{s['ttft_p99']:.2f}", f"{s['within_sla'] * 100:.1f}%",
             f"{s['cpu_ms_per_req']:.2f}",
             *([f"{s['idle_cpu_ms_per_s']:.1f}", f"{s['idle_ms_per_req']:.2f}"] if a.idle_s else []),
             f"{s['send_lag_p95']:.2f}", f"{s['wall_s']:.0f}"]
            for name, s in results.items()]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load} (1/5/15 min)\n{head}")
    print(table(["target", "requests", "ok", "failed", "hit (engines)", "of LRU bound", "TTFT p50", "TTFT p95",
                 "TTFT p99", f"TTFT<={a.sla}s", "router CPU ms/req",
                 *(["idle CPU ms/s", "of it idle ms/req"] if a.idle_s else []), "send lag p95", "wall s"], rows))
    png = plot_trace_targets(Path(a.png) if a.png else OUT / f"{a.out}.png", results, bounds, a.sla,
                             f"{2 * a.nodes} MI355X ranks over HTTP, {len(sl)} requests of the conversation trace "
                             f"({a.slice_s / 60:g} min, time scale {a.time_scale:g})")
    print(f"wrote {png}", file=sys.stderr)


def fleet_args(p: argparse.ArgumentParser, *, slice_s: float, time_scale: float) -> None:
    """The trace slice, the simulated fleet and the routers' settings (fleet_trace.py and fleet_capacity.py)."""
    p.add_argument("--trace", required=True, help="Mooncake JSONL (512-token hash_ids)")
    p.add_argument("--slice-start-s", type=float, default=0.0)
    p.add_argument("--slice-s", type=float, default=slice_s)
    p.add_argument("--limit", type=int, default=None, help="only the slice's first N requests (smoke runs)")
    p.add_argument("--nodes", type=int, default=2, help="MI355X nodes of 2 TP4 ranks each")
    p.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per rank (default: the profile's 2.4M)")
    p.add_argument("--time-scale", type=float, default=time_scale, help="simulators and arrivals k times faster")
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--sla", type=float, default=2.22, help="TTFT SLA, simulated s")
    p.add_argument("--priority-scheduling", action="store_true", help="the simulators schedule by priority "
                   "(--enable-priority-scheduling, as deploy/sglang/ starts SGLang): this router's prefill levels apply")
    p.add_argument("--schedule-policy", choices=sorted(SCHEDULE_POLICIES), default=None,
                   help="the simulators' --schedule-policy; shortest-prefill-first (SGLang 0.5.21+) excludes "
                   "--priority-scheduling, as SGLang does")
    p.add_argument("--ttft-quantile-z", type=float, default=None)
    p.add_argument("--routing-set", action="append", metavar="KEY=VALUE",
                   help="a routing setting for this router (repeatable), e.g. recompute_weight=0")
    p.add_argument("--concurrency", type=int, default=1024, help="most requests in flight")
    p.add_argument("--idle-s", type=float, default=0.0, help="first each router's CPU over this long with no request "
                   "(its polls, heartbeats, timers): columns idle CPU ms/s and the share of router CPU per request "
                   "it accounts for over the replay")


def ports(p: argparse.ArgumentParser) -> None:
    """The figure's path, the ports and the progress bar (fleet_trace.py and fleet_capacity.py)."""
    p.add_argument("--png", default=None, help="the figure's path (default loadtests/out/<out>.png)")
    p.add_argument("--port", type=int, default=19000)
    p.add_argument("--sim-port", type=int, default=19100)
    p.add_argument("--redis-port", type=int, default=19390)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr) while a target replays")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_args(p, slice_s=1200.0, time_scale=12.0)
    p.add_argument("--targets", default="this router,SGLang router cache_aware,vllm-router cache_aware,"
                                        "LiteLLM least-busy,this router / round_robin")
    p.add_argument("--out", default="fleet_trace", help="results: loadtests/out/<out>.json")
    ports(p)
    a = p.parse_args()
    if a.schedule_policy == SHORTEST_PREFILL_FIRST and a.priority_scheduling:
        p.error("--schedule-policy shortest-prefill-first and --priority-scheduling: SGLang allows one or the other")
    a.b200_replicas, a.gateways = 0, 1  # fleet_http's launchers read these: MI355X ranks only, one gateway
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` blocks stop what the run started
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
