"""The noisy-neighbour scenario over HTTP: two tenants through real gateway processes in front of simulated
replicas, without and with flow control, in one run.

    .venv/bin/python -m loadtests.flow_http --victim /work/shared/traces/conversation_trace.jsonl \\
        --aggressor loadtests/out/agent_trace.jsonl --nodes 4 --window-s 120 --time-scale 10

Tenant B replays the victim trace as recorded, tenant A the aggressor trace sped up to `--aggressor-x` times B's
demand (gateway_lab/replay/mix.py: the same mixer and demand unit as `gateway replay --noisy`). Two gateway
instances share one Redis; each tenant's requests alternate between them as a load balancer would spread them
(`--split`: B only on the first, A only on the second — each instance's queue then holds one tenant, and only the
shared tags tell it about the other). The simulators and the arrivals run `--time-scale` times faster
than real time (below 1: slower); the gateways' SLA, timing and flow-control times are stated in wall seconds
accordingly, and TTFTs are reported in simulated seconds. A refusal (429/503 from flow control) is counted with its
status, never as lost.

The columns are those of `gateway replay --noisy`: within SLA of every request and of those that could meet it at all
(TTFT alone on an idle simulated rank holding the prefix it was reported to have cached), goodput (prefill-weighted
tokens per simulated second of the requests within their SLA, over the window), Jain's index over goodput normalised
by the weighted max-min fair share. `--alone` adds the B-alone and A-alone runs the goodput bar compares against.
*Send lag p95*: how late the client sent requests against their trace time, in wall seconds — a harness that keeps
up sends on time; B alone against `gateway replay --noisy`'s B alone says whether the simulators and gateways do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gateway.config import hash_key
from gateway.flow.settings import FlowControl
from gateway.recording.trace import TraceRecord, read_trace
from gateway_lab.replay.http import HttpResult, run_http
from gateway_lab.replay.mix import Part, demand, jain_of, mix, possible_demand, units
from gateway_lab.sim.fleet import idle_ttft
from gateway_lab.sim.profiles import profile
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
            "outlier_detection": {"enabled": not a.no_outlier_detection},
            "timeouts": {"first_byte": 600, "total": 3000, "idle": 120}}


def tenant_row(label: str, tenant: str, trace: list[TraceRecord], res: list[HttpResult], sla: float,
               window_s: float) -> dict[str, Any]:
    """One tenant's measures (`res` in `trace`'s order); TTFTs in simulated seconds."""
    fc, cfg = FlowControl(), profile("mi355x-glm52-tp4")
    ok = [(t, r) for t, r in zip(trace, res) if r.ok and r.ttft is not None]
    ttft = sorted(r.ttft for _, r in ok if r.ttft is not None)
    refused: dict[str, int] = {}
    for r in res:
        if not r.ok:
            refused[r.error] = refused.get(r.error, 0) + 1
    # a refusal is a 429/503 naming its reason (the error body's code, flow_...); anything else is lost
    lost = sum(n for e, n in refused.items() if not e.startswith(("HTTP 429 ", "HTTP 503 ")))

    def possible(t: TraceRecord, r: HttpResult) -> bool:  # a refused request counts as possible, as on the clock
        return not r.ok or idle_ttft(cfg, t.input_length, r.cached_tokens) <= sla

    def unit(t: TraceRecord, r: HttpResult) -> float:
        return units(fc, r.prompt_tokens or t.input_length, r.cached_tokens, t.output_length)

    within = [(t, r) for t, r in ok if r.ttft is not None and r.ttft <= sla]
    n_possible = sum(possible(t, r) for t, r in zip(trace, res))
    return {"label": label, "tenant": tenant, "requests": len(res), "within": len(within) / max(1, len(res)),
            "possible": sum(possible(t, r) for t, r in within) / max(1, n_possible),
            "p95": nearest_rank(ttft, 0.95), "refused": refused, "lost": lost,
            "goodput": sum(unit(t, r) for t, r in within) / window_s, "demand": demand(trace, fc, window_s),
            "can_meet": possible_demand(trace, fc, cfg, sla, window_s),
            "lag": nearest_rank(sorted(r.lag for r in res), 0.95)}


def rows_of(run: list[dict[str, Any]]) -> list[list[Any]]:
    """A run's rows with its fleet goodput and Jain's index (equal weights; a tenant asking for less than its
    share is owed its demand), on every request's demand and on the demand that can meet the SLA at all."""
    total = sum(t["goodput"] for t in run)
    goodput, weights = {t["tenant"]: t["goodput"] for t in run}, {t["tenant"]: 1.0 for t in run}
    j = jain_of(goodput, {t["tenant"]: t["demand"] for t in run}, weights)
    jp = jain_of(goodput, {t["tenant"]: t["can_meet"] for t in run}, weights)
    return [[t["label"], t["tenant"], t["requests"], f"{t['within'] * 100:.1f}%", f"{t['possible'] * 100:.1f}%",
             f"{t['p95']:.2f}", ", ".join(f"{k} {v}" for k, v in sorted(t["refused"].items())) or "0",
             f"{t['goodput'] / 1000:.1f}k", f"{t['demand'] / 1000:.1f}k", f"{total / 1000:.1f}k", f"{j:.3f}", f"{jp:.3f}",
             f"{t['lag']:.2f}", t["lost"]] for t in run]


def dump_rows(a: argparse.Namespace, label: str, tenants: Any, where: dict[int, int]) -> None:
    """One JSON line per request of the run (`--dump`): what the client saw and what the gateway's headers said
    (replica, routing branch, time held by flow control), times in simulated seconds; read by
    loadtests/flow_tail.py."""
    cfg = profile("mi355x-glm52-tp4")
    with open(a.dump, "ab") as f:
        for tenant, trace, res in tenants:
            for t, r in zip(trace, res):
                f.write(orjson.dumps({
                    "run": label, "tenant": tenant, "instance": where.get(id(r), 0), "at": t.timestamp_ms / 1000,
                    "sent": r.sent * a.time_scale, "input": t.input_length, "output": t.output_length,
                    "cached": r.cached_tokens, "ok": r.ok, "error": r.error, "ttft": r.ttft, "wait": r.flow_wait,
                    "replica": r.replica, "route": r.route, "predicted": r.predicted,
                    "idle_ttft": idle_ttft(cfg, t.input_length, r.cached_tokens)}) + b"\n")


HEADERS = ["run", "tenant", "requests", "within SLA", "of those possible", "TTFT p95", "refused / failed", "goodput",
           "demand", "fleet goodput", "Jain", "Jain, of those possible", "send lag p95", "lost"]


async def run(a: argparse.Namespace, work: Path, label: str, flow: bool, b: list[TraceRecord],
              aggr: list[TraceRecord]) -> list[dict[str, Any]]:
    sims, mi, _ = start_sims(a, work, label.replace(" ", "_"))
    procs: list[Proc] = []
    try:
        path = work / f"gw-{'flow' if flow else 'none'}.yaml"
        # each arm its own keys in the run's Redis: an earlier arm's prefix index (entries for the replicas it ran,
        # whose caches this arm's fresh simulators do not hold) and fair tags must not steer this one
        path.write_text(yaml.safe_dump(gateway_config(a, mi, f"redis://127.0.0.1:{a.redis_port}/0", flow,
                                                      f"{label.replace(' ', '-')}:")))
        urls = []
        for i in range(1 if a.one_instance else 2):
            port = a.port + 2 * i
            procs.append(Proc(f"gateway-{i}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
                                               "--port", str(port)], f"http://127.0.0.1:{port}/healthz",
                              log=work / f"gw-{label.replace(' ', '_')}-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}/v1")
        for p in procs:
            p.wait_ready(120)
        # the trace's clock starts at 0 for both tenants: an empty tenant's slice is sent nothing
        origin = min((tr[0].timestamp_ms for tr in (b, aggr) if tr), default=0.0)
        if a.split:  # each tenant on its own instance: the shared tags alone carry the other's service
            parts = await asyncio.gather(*(_send(tr, urls[i], KEYS[t], a, origin)
                                           for i, (t, tr) in enumerate((("B", b), ("A", aggr)))))
            rb, ra = parts
            ob, oa = b, aggr
            where = {id(r): i for i, p in enumerate(parts) for r in p}
        else:  # a load balancer's spread: every other request of each tenant to each instance (--one-instance: one)
            n = len(urls)
            parts = await asyncio.gather(*(_send(tr[i::n], urls[i], KEYS[t], a, origin)
                                           for t, tr in (("B", b), ("A", aggr)) for i in range(n)))
            rb, ra = [r for p in parts[:n] for r in p], [r for p in parts[n:] for r in p]
            ob, oa = [r for i in range(n) for r in b[i::n]], [r for i in range(n) for r in aggr[i::n]]
            where = {id(r): k % n for k, p in enumerate(parts) for r in p}
        await sim_lag(label, mi)
    finally:
        for p in procs + sims:
            p.stop()
    for r in rb + ra:  # wall seconds -> simulated seconds
        r.ttft = None if r.ttft is None else r.ttft * a.time_scale
        r.flow_wait = None if r.flow_wait is None else r.flow_wait * a.time_scale
        r.predicted = None if r.predicted is None else r.predicted * a.time_scale
    if a.dump:
        dump_rows(a, label, (("B", ob, rb), ("A", oa, ra)), where)
    return [tenant_row(label, t, tr, res, a.sla, a.window_s) for t, tr, res in (("B", ob, rb), ("A", oa, ra)) if tr]


async def sim_lag(label: str, urls: list[str]) -> None:
    """Did the simulators keep time through the arm? Each rank's forward steps against the model's durations and how
    late they completed (gateway_lab/sim/realtime.py), printed: a late simulator makes every TTFT late, whatever
    the gateway decided."""
    rows = []
    async with httpx.AsyncClient(timeout=10) as c:
        for u in urls:
            try:
                lag = (await c.get(u + "/_sim/state")).json()["ranks"][0]["lag"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                continue
            rows.append(lag)
    if rows:
        print(f"{label}: simulators' step time vs model {max(r['step_time_ratio'] for r in rows) - 1:+.1%} (worst rank), "
              f"step lag p99 {max(r['p99_lag_s'] for r in rows) * 1000:.0f} ms, max {max(r['max_lag_s'] for r in rows) * 1000:.0f} "
              f"ms, resyncs {sum(r['resyncs'] for r in rows)}", file=sys.stderr)


async def _send(trace: list[TraceRecord], url: str, key: str, a: argparse.Namespace,
                origin_ms: float) -> list[HttpResult]:
    """`trace` open-loop against `url`, timed from `origin_ms` (the run's first arrival, whoever's it is)."""
    return await run_http(trace, url, MODEL, key, a.time_scale, a.concurrency, origin_ms=origin_ms) if trace else []


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
    arms: list[tuple[str, bool, list[TraceRecord], list[TraceRecord]]] = []
    if a.alone:
        arms += [("B alone", True, b, []), ("A alone", True, [], aggr)]
    arms += [("no flow control", False, b, aggr), ("flow control", True, b, aggr)]
    if a.arms:
        arms = [arm for arm in arms if arm[0] in a.arms.split(",")]
    try:
        for label, flow, tb, ta in arms:
            rows += rows_of(await run(a, work, label, flow, tb, ta))
            print(f"  {label}: done (logs in {work})", file=sys.stderr, flush=True)
    finally:
        redis.stop()
    print(f"\nnoisy neighbour over HTTP: {2 * a.nodes} MI355X TP4 ranks, time scale {a.time_scale:g}, first "
          f"{a.window_s:.0f} s; B = {a.victim} ({len(b)} requests), A = {a.aggressor} at "
          f"{a.aggressor_x:g}x B's demand (speed {speed:.2f}, {len(aggr)} requests), "
          f"{'B on instance 1 and A on instance 2' if a.split else 'one instance' if a.one_instance else 'each spread over two instances'}, one Redis; "
          f"TTFT in simulated s, SLA {a.sla} s; latency outlier ejection {'off' if a.no_outlier_detection else 'on'}; "
          f"engines {'' if a.priority_scheduling else 'not '}scheduling by "
          f"priority, flow.under_share_priority "
          f"{a.under_share_priority if a.under_share_priority is not None else FlowControl().under_share_priority}")
    print(table(HEADERS, rows))


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
    p.add_argument("--alone", action="store_true", help="also B alone and A alone (flow control on, as `gateway "
                   "replay --noisy` runs them): what the goodput bar compares against")
    p.add_argument("--one-instance", action="store_true", help="one gateway instance (no --split): the virtual "
                   "clock's setting, one queue")
    p.add_argument("--arms", default=None, help="only these runs, comma-separated (B alone, A alone, no flow "
                   "control, flow control)")
    p.add_argument("--no-outlier-detection", action="store_true", help="outlier_detection.enabled: false in the "
                   "gateways (latency outlier ejection off: dispatch/outliers.py)")
    p.add_argument("--dump", default=None, help="append one JSON line per request to this file (the client's view "
                   "and the gateway's replica, routing branch and flow wait): loadtests/flow_tail.py reads it")
    p.add_argument("--sim-port", type=int, default=24100)
    p.add_argument("--port", type=int, default=24300)
    p.add_argument("--redis-port", type=int, default=24390)
    args = p.parse_args()
    if args.split and args.one_instance:
        p.error("--split needs two instances")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
