"""Capacity at SLA over HTTP: each router's highest trace speed at which the fleet still serves a slice of a trace
with at least `--target` of its requests within the TTFT SLA, in one run, with the routers' CPU beside it.

    .venv/bin/python -m loadtests.fleet_capacity --trace /work/shared/traces/conversation_trace.jsonl \\
        --slice-s 1200 --time-scale 5 --nodes 4 --speeds 1,1.25,1.5 --peer-speeds 0.75,1,1.25

A *speed* s replays the slice's arrivals s times closer together on the same fleet (the load rises s-fold); the
simulators keep their own speed. `--time-scale` compresses simulators and arrivals alike to save wall time, as in
fleet_trace.py (TTFT in simulated seconds). Each (router, speed) is one run of fleet_trace's `run_target`: fresh
simulators (cold caches), the router started anew, the slice replayed open-loop. Per router the speeds are tried in
order and the sweep stops at the first that misses the target, so the capacity is the highest speed that meets it
below the first miss (one that meets it after a miss would be luck, not capacity). Refused or failed requests count
as outside the SLA. Goodput at SLA: the requests within the SLA per simulated second at that speed.

Prints the sweep and the capacity table (with each router's capacity as a multiple of the others'), writes
loadtests/out/<out>.json and a PNG (within SLA against speed per router, the target as a line).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis as redis_lib

from gateway.recording.trace import TraceRecord
from loadtests.fleet_http import redis_proc
from loadtests.fleet_trace import fleet_args, ports, run_target, the_slice
from loadtests.report import OUT, save_figure, save_json, table


def faster(sl: list[TraceRecord], speed: float) -> list[TraceRecord]:
    """The slice with its arrivals `speed` times closer together (same requests, same order)."""
    return [TraceRecord(r.timestamp_ms / speed, r.input_length, r.output_length, r.hash_ids, r.tenant) for r in sl]


def within_all(s: dict[str, Any], sla: float) -> float:
    """Of every request sent (a failed one is not within), the share with its first token within the SLA."""
    return float(sum(x <= sla for x in s["ttfts"]) / max(1, s["requests"]))


def capacity(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The highest-speed point meeting the target below the first that misses (points in speed order)."""
    best = None
    for p in points:
        if p["within_all"] < target:
            break
        best = p
    return best


def plot(path: Path, sweep: dict[str, list[dict[str, Any]]], target: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name, points in sweep.items():
        xs = [p["speed"] for p in points]
        axes[0].plot(xs, [p["within_all"] * 100 for p in points], marker="o", label=name)
        axes[1].plot(xs, [p["cpu_ms_per_req"] for p in points], marker="o", label=name)
    axes[0].axhline(target * 100, color="gray", linestyle="--", label=f"target {target * 100:g}%")
    axes[0].set_xlabel("trace speed (x the slice's own arrival rate)")
    axes[0].set_ylabel("requests with TTFT within the SLA (%)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("trace speed")
    axes[1].set_ylabel("router CPU per request (ms)")
    axes[1].legend(fontsize=8)
    return save_figure(fig, path, title)


async def main_async(a: argparse.Namespace) -> None:
    sl = the_slice(a)
    ours = [float(x) for x in a.speeds.split(",")]
    theirs = [float(x) for x in a.peer_speeds.split(",")] if a.peer_speeds else ours
    span = (sl[-1].timestamp_ms - sl[0].timestamp_ms) / 1000
    work = Path(tempfile.mkdtemp(prefix="gw-fleet-capacity-"))
    redis = redis_proc(a.redis_port, work)
    await asyncio.sleep(0.5)
    sweep: dict[str, list[dict[str, Any]]] = {}
    try:
        for name in (n.strip() for n in a.targets.split(",")):
            sweep[name] = []
            for speed in ours if name.startswith("this router") else theirs:
                # every run starts from an empty Redis: the gateway's key prefix is the same for each of its runs
                # here, and a run must not start from another's prefix index (replicas "warm" that are cold)
                redis_lib.Redis(port=a.redis_port).flushall()
                try:
                    s = await run_target(a, work, name, f"redis://127.0.0.1:{a.redis_port}/0", faster(sl, speed))
                except RuntimeError as e:  # a peer that does not start here is reported, not the end of the run
                    print(f"  {name}: {e} (logs in {work})", file=sys.stderr, flush=True)
                    s = None
                if s is None:
                    break
                point = {"speed": speed, "within_all": within_all(s, a.sla),
                         "goodput_rps": sum(x <= a.sla for x in s["ttfts"]) / (span / speed),
                         **{k: v for k, v in s.items() if k != "ttfts"}}
                sweep[name].append(point)
                save_json(a.out, {"args": vars(a), "sweep": sweep})  # a crash loses nothing
                print(f"  {name} at speed {speed:g}: {point['within_all'] * 100:.1f}% within SLA", file=sys.stderr,
                      flush=True)
                if point["within_all"] < a.target:
                    break
            if not sweep[name]:
                del sweep[name]
    finally:
        redis.stop()
    head = (f"{a.trace} [{a.slice_start_s:g}, {a.slice_start_s + a.slice_s:g}) s: {len(sl)} requests over {span:.0f} s "
            f"({len(sl) / span:.2f} req/s at speed 1); {2 * a.nodes} MI355X TP4 ranks, time scale {a.time_scale:g}; "
            f"SLA {a.sla} s, target {a.target * 100:g}% within it")
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load} (1/5/15 min)\n{head}\n")
    rows = [[name, f"{p['speed']:g}", p["requests"], p["failed"], f"{p['engine_hit'] * 100:.1f}%",
             f"{p['ttft_p50']:.2f}", f"{p['ttft_p95']:.2f}", f"{p['within_all'] * 100:.1f}%",
             f"{p['cpu_ms_per_req']:.2f}", f"{p['send_lag_p95']:.2f}"]
            for name, points in sweep.items() for p in points]
    print(table(["router", "speed", "requests", "failed", "hit (engines)", "TTFT p50", "TTFT p95", "within SLA",
                 "router CPU ms/req", "send lag p95"], rows))
    caps = {name: capacity(points, a.target) for name, points in sweep.items()}
    rows = []
    for name, c in caps.items():
        others = ", ".join(f"{c['speed'] / o['speed']:.2f}x {other}" for other, o in caps.items()
                           if other != name and o is not None and c is not None)
        rows.append([name, f"{c['speed']:g}" if c else "below the first speed",
                     f"{c['goodput_rps']:.2f}" if c else "-", f"{c['cpu_ms_per_req']:.2f}" if c else "-",
                     others or "-"])
    print("\n" + table(["router", "capacity (speed)", "goodput at SLA (req/s)", "router CPU ms/req there",
                        "capacity against the others"], rows))
    png = plot(Path(a.png) if a.png else OUT / f"{a.out}.png", sweep, a.target,
               f"Capacity at SLA: {2 * a.nodes} MI355X ranks over HTTP, {len(sl)} requests, time scale {a.time_scale:g}")
    print(f"wrote {png}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_args(p, slice_s=600.0, time_scale=5.0)
    p.add_argument("--speeds", default="1,1.5,2,2.5,3", help="trace speeds to try, in order")
    p.add_argument("--peer-speeds", default=None, help="the peers' speeds, if not --speeds (a sweep that stops at "
                   "the first miss spends no time past it, but starting below it takes the runs from there)")
    p.add_argument("--target", type=float, default=0.9, help="share of requests within the SLA that counts as served")
    p.add_argument("--targets", default="this router,SGLang router cache_aware,vllm-router cache_aware")
    p.add_argument("--out", default="fleet_capacity", help="results: loadtests/out/<out>.json")
    ports(p)
    a = p.parse_args()
    a.b200_replicas, a.gateways = 0, 1  # fleet_http's launchers read these: MI355X ranks only, one gateway
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` blocks stop what the run started
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
