"""A gray failure: one replica of four slowed k-fold (prefill alone, then decode alone) under steady load, through
the gateway over real HTTP. Does routing see it, move new load off it, keep the fleet's TTFT, and take it back when
the fault clears?

    .venv/bin/python -m loadtests.gray_failure --rate 5 --phase-s 60

Four simulated MI355X replicas (one process) and one gateway (`gateway serve`, admin API on its own port), steady
Poisson arrivals of streamed chats (Wafer-shaped, smaller: 16 groups sharing a 2,000-token prefix, 4,000-token
prompts, 64 output tokens). One run per scenario, each on fresh processes with the same seed (the same arrivals and
prompts): the no-fault run, then each slowed phase. A run is `phase-s` warm; then `POST /_sim/fault {"kind": "slow",
"phase": ..., "factor": k}` on the last replica (nothing in the no-fault run) for 30 s + `phase-s`; then `phase-s`
after `{"kind": "clear"}`. `/admin/state` is read every second.

Columns: when (after the fault) the slow replica's predicted TTFT passed twice its peers' median, and when it was
ejected (and on which signals); its share of new requests in the no-fault run and in the slowed run from 30 s into the
fault to its end, and in the last 20 s after the clear; fleet TTFT p95 and inter-token latency p95 over that fault
window, the no-fault run's against the slowed run's; when, after the clear, it took at least half its fair share over
10 s again. Also when its own TTFT correction reached 1.5 (and the highest its peers' reached meanwhile): a prediction
crossing can also be a long prefill queued on it, which the no-fault run shows too. Writes
loadtests/out/gray_failure.json (or `--out`): each scenario's figures, every request and the slow replica's state
each second.

Several seeds, judged against the no-fault runs' own spread:

    .venv/bin/python -m loadtests.gray_failure --seed 1 --out loadtests/out/gray-1.json
    .venv/bin/python -m loadtests.gray_failure --report loadtests/out/gray-0.json loadtests/out/gray-1.json

`--report` reads saved runs and prints one row per seed and scenario, with what the slow replica's own requests did
to the fleet's TTFT p95: how many of the fault window's requests it served (their median TTFT), and the p95 of the
window without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from loadtests.fleet_http import MI355X_PRICE, MI355X_TIMING, wall_timing
from loadtests.procs import Proc
from loadtests.workload import WaferWorkload

KEY = "sk-gray"
ADMIN = "admin-gray"
REPLICAS = 4
SETTLE_S = 30.0  # the must-show's "within 30 s": windows after a fault start this far into it


def p95(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))]


class Run:
    def __init__(self, a: argparse.Namespace, url: str, admin: str) -> None:
        self.a = a
        self.url = url
        self.admin = admin
        self.t0 = time.monotonic()
        self.records: list[dict[str, Any]] = []
        self.polls: list[dict[str, Any]] = []
        self.wl = WaferWorkload(groups=16, prefix_tokens=2000, prompt_tokens=4000, output_tokens=a.max_tokens,
                                seed=a.seed)
        self.stop = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, c: httpx.AsyncClient, body: dict[str, Any]) -> None:
        rec: dict[str, Any] = {"sent": self.now(), "ok": False}
        try:
            async with c.stream("POST", self.url + "/v1/chat/completions", json=body,
                                headers={"authorization": f"Bearer {KEY}"}) as r:
                rec["replica"] = r.headers.get("x-gateway-replica")
                if r.status_code != 200:
                    rec["status"] = r.status_code
                    await r.aread()
                    return
                first = None
                completion = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if first is None and d.get("choices") and d["choices"][0].get("delta", {}).get("content"):
                        first = self.now()
                    if d.get("usage"):
                        completion = d["usage"].get("completion_tokens") or 0
                end = self.now()
                if first is not None:
                    rec.update(ok=True, ttft=first - rec["sent"],
                               itl=(end - first) / (completion - 1) if completion > 1 else None)
        except httpx.HTTPError as e:
            rec["error"] = type(e).__name__
        finally:
            self.records.append(rec)

    async def load(self) -> None:
        rng = random.Random(self.a.seed)
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as c:
            next_at = self.now()
            while not self.stop:
                next_at += rng.expovariate(self.a.rate)
                await asyncio.sleep(max(0.0, next_at - self.now()))
                body = self.wl.body(self.wl.group_of(0), self.a.max_tokens)
                t = asyncio.create_task(self.one(c, body))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def poll(self) -> None:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
            while not self.stop:
                try:
                    r = await c.get(self.admin + "/admin/state", params={"uncached_tokens": 2000},
                                    headers={"authorization": f"Bearer {ADMIN}"})
                    reps = {x["name"]: x for p in r.json()["pools"] for x in p["replicas"]}
                    self.polls.append({"t": self.now(), "replicas": reps})
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(1.0)


def window(records: list[dict[str, Any]], lo: float, hi: float) -> list[dict[str, Any]]:
    return [r for r in records if lo <= r["sent"] < hi]


def share(records: list[dict[str, Any]], name: str) -> float | None:
    routed = [r for r in records if r.get("replica")]
    return sum(r["replica"] == name for r in routed) / len(routed) if routed else None


def scenario(run: Run, phase: str, start: float, fault_at: float, clear_at: float, end: float,
             slow: str, metrics_at_peak: str) -> dict[str, Any]:
    recs = run.records
    base = window(recs, start + SETTLE_S, fault_at)
    during = window(recs, fault_at + SETTLE_S, clear_at)
    after = window(recs, end - 20.0, end)
    peers = [f"mi355x-{i}" for i in range(REPLICAS) if f"mi355x-{i}" != slow]
    rise = ejected = learned = None
    peak_peer_correction = 0.0
    for p in run.polls:
        if p["t"] < fault_at or p["t"] > clear_at:
            continue
        reps = p["replicas"]
        peer = statistics.median(reps[x]["predicted_ttft_s"] for x in peers)
        if rise is None and reps[slow]["predicted_ttft_s"] >= 2 * peer:
            rise = p["t"] - fault_at
        # its own learned factor: specific to the replica, where a prediction crossing can be a queued long prefill
        if learned is None and reps[slow]["ttft_correction"] >= 1.5:
            learned = p["t"] - fault_at
        peak_peer_correction = max(peak_peer_correction, *(reps[x]["ttft_correction"] for x in peers))
        if ejected is None and reps[slow]["outlier"]["ejected"]:
            ejected = p["t"] - fault_at
    back = None
    routed_after = [r for r in recs if r["sent"] >= clear_at and r.get("replica")]
    for t in range(int(clear_at), int(end)):
        w = [r for r in routed_after if t <= r["sent"] < t + 10]
        if len(w) >= 10 and sum(r["replica"] == slow for r in w) / len(w) >= 0.5 / REPLICAS:
            back = t - clear_at
            break
    reasons = sorted({p["replicas"][slow]["outlier"]["ejected"]["reason"] for p in run.polls
                      if fault_at <= p["t"] <= clear_at and p["replicas"][slow]["outlier"]["ejected"]})
    peak = max((p for p in run.polls if fault_at <= p["t"] <= clear_at),
               key=lambda p: p["replicas"][slow]["ttft_correction"], default=None)

    def ok(rs: list[dict[str, Any]], k: str) -> list[float]:
        return [r[k] for r in rs if r["ok"] and r.get(k) is not None]

    return {
        "phase": phase, "factor": run.a.factor, "slow": slow,
        "predicted_rise_s": rise, "correction_1_5_s": learned, "peers_peak_correction": peak_peer_correction,
        "ejected_s": ejected, "reasons": reasons,
        "share_base": share(base, slow), "share_fault": share(during, slow), "share_after": share(after, slow),
        "ttft_p95_base": p95(ok(base, "ttft")), "ttft_p95_fault": p95(ok(during, "ttft")),
        "ttft_p95_after": p95(ok(after, "ttft")),
        "itl_p95_base": p95(ok(base, "itl")), "itl_p95_fault": p95(ok(during, "itl")),
        "back_in_s": back, "requests": len(window(recs, start, end)),
        "failed": sum(not r["ok"] for r in window(recs, start, end)),
        "peak_state": peak["replicas"][slow] if peak else None, "metrics_at_peak": metrics_at_peak,
    }


async def drive(a: argparse.Namespace, run: Run, phase: str) -> dict[str, Any]:
    """One run: `phase-s` warm, then the fault (none: nothing happens) for 30 s + `phase-s`, then `phase-s` after."""
    slow = f"mi355x-{REPLICAS - 1}"
    slow_url = f"http://127.0.0.1:{a.sim_port + REPLICAS - 1}"
    load = asyncio.create_task(run.load())
    poll = asyncio.create_task(run.poll())
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
        start = run.now()
        await asyncio.sleep(a.phase_s)
        fault_at = run.now()
        admin = {"authorization": f"Bearer {ADMIN}"}
        if phase == "drained":  # the reference: the replica taken out by hand, as if on-call had found it at once
            (await c.post(f"{run.admin}/admin/replicas/{slow}/drain", headers=admin)).raise_for_status()
        elif phase != "none":
            r = await c.post(slow_url + "/_sim/fault", json={"kind": "slow", "phase": phase, "factor": a.factor})
            r.raise_for_status()
        await asyncio.sleep(SETTLE_S + 15)
        text = (await c.get(run.admin + "/metrics")).text  # the admin listener
        lines = "\n".join(x for x in text.splitlines() if f'replica="{slow}"' in x and not x.startswith("#")
                          and ("ejected" in x or "correction" in x or "ejections_total" in x or "ttft_predicted" in x))
        await asyncio.sleep(a.phase_s - 15)
        clear_at = run.now()
        if phase == "drained":
            (await c.post(f"{run.admin}/admin/replicas/{slow}/undrain", headers=admin)).raise_for_status()
        elif phase != "none":
            (await c.post(slow_url + "/_sim/fault", json={"kind": "clear"})).raise_for_status()
        await asyncio.sleep(a.phase_s)
        out = scenario(run, phase, start, fault_at, clear_at, run.now(), slow, lines)
        # the raw material, for reading a figure back: every request, and the slow replica's state each second
        out["fault_at"], out["clear_at"] = fault_at, clear_at
        out["records"] = run.records
        out["timeline"] = [{"t": p["t"], "correction": p["replicas"][slow]["ttft_correction"],
                            "predicted": p["replicas"][slow]["predicted_ttft_s"],
                            "ejected": bool(p["replicas"][slow]["outlier"]["ejected"]),
                            "probing": bool(p["replicas"][slow]["outlier"].get("probing"))} for p in run.polls]
    run.stop = True
    await asyncio.gather(load, poll)
    print(json.dumps({k: v for k, v in out.items() if k not in ("peak_state", "metrics_at_peak", "records", "timeline")}), file=sys.stderr)
    return out


def fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{100 * v:.0f}%"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """Each slowed run next to the no-fault run (same seed: the same arrivals and prompts), over the same windows."""
    none = next(r for r in rows if r["phase"] == "none")
    head = ("| slowed | predicted TTFT 2x peers after | own correction >= 1.5 after (peers' peak) | ejected after "
            "(why) | its share: no-fault run / fault / after clear | fleet TTFT p95: no-fault run / fault (Δ) | fleet ITL p95: no-fault run / fault (Δ) | back in "
            "service after clear | requests (failed) |\n|---|---|---|---|---|---|---|---|---|")
    out = [head]

    def delta(x: float | None, base: float | None) -> str:
        return "—" if not x or not base else f"{100 * (x / base - 1):+.0f}%"

    for r in rows:
        if r["phase"] == "none":
            continue
        ms = lambda v: None if v is None else 1000 * v  # noqa: E731
        label = "drained by hand" if r["phase"] == "drained" else f"{r['phase']} x{r['factor']:g}"
        out.append(
            f"| {label} | {fmt(r['predicted_rise_s'])} s | {fmt(r['correction_1_5_s'])} s "
            f"({r['peers_peak_correction']:.2f}) | {fmt(r['ejected_s'])} s "
            f"({', '.join(r['reasons']) or '—'}) | {fmt(none['share_fault'], True)} / {fmt(r['share_fault'], True)} / "
            f"{fmt(r['share_after'], True)} | {fmt(none['ttft_p95_fault'])} / {fmt(r['ttft_p95_fault'])} s "
            f"({delta(r['ttft_p95_fault'], none['ttft_p95_fault'])}) | {fmt(ms(none['itl_p95_fault']))} / "
            f"{fmt(ms(r['itl_p95_fault']))} ms ({delta(r['itl_p95_fault'], none['itl_p95_fault'])}) | "
            f"{fmt(r['back_in_s'])} s | {r['requests']} ({r['failed']}) |")
    return "\n".join(out)


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.0f}% [{min(xs):+.0f}%, {max(xs):+.0f}%]" if xs else "—"


def report(paths: list[str]) -> str:
    """Saved runs (one file a seed: the no-fault run and each scenario, with their requests) -> a row per seed and
    scenario, then the median and range of the TTFT p95 change per scenario over the seeds."""
    head = ("| slowed | seed | own correction >= 1.5 after (peers' peak) | ejected after (why); ejections in the fault "
            "| its requests 0-20 / 20-40 s into the fault | its requests in the window (their TTFT p50) "
            "| its share: fault / after clear | peers' shares "
            "| fleet TTFT p95: no-fault run / fault (Δ) | fleet TTFT p95 without its requests (Δ) "
            "| fleet ITL p95 Δ | in routing after clear | half its fair share after clear |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out, deltas, nofault, spread = [head], {}, [], []
    oracle: dict[str, list[float]] = {}  # against the same seed's replica drained at the fault's moment
    for path in paths:
        rows = json.loads(Path(path).read_text())
        none = next(r for r in rows if r["phase"] == "none")
        drained = next((r for r in rows if r["phase"] == "drained"), None)
        seed = Path(path).stem
        nofault.append(none["ttft_p95_fault"])
        calm = window(none["records"], none["fault_at"] + SETTLE_S, none["clear_at"])
        spread.append("/".join(f"{100 * (share(calm, f'mi355x-{i}') or 0):.0f}" for i in range(REPLICAS)) + "%")
        for r in rows:
            if r["phase"] == "none":
                continue
            during = [x for x in window(r["records"], r["fault_at"] + SETTLE_S, r["clear_at"]) if x["ok"]]
            mine = [x["ttft"] for x in during if x.get("replica") == r["slow"]]
            # what the detector had to judge it on (min_samples within window_s): its requests as the fault began
            early = [sum(1 for x in window(r["records"], r["fault_at"] + lo, r["fault_at"] + lo + 20)
                         if x.get("replica") == r["slow"]) for lo in (0, 20)]
            without = p95([x["ttft"] for x in during if x.get("replica") != r["slow"]])
            states = [p["ejected"] for p in r["timeline"] if r["fault_at"] <= p["t"] <= r["clear_at"]]
            ejections = sum(1 for a, b in zip([False, *states], states) if b and not a)
            # in routing: neither ejected nor probing (one request at a time) at a poll after the clear
            back = next((p["t"] - r["clear_at"] for p in r["timeline"] if p["t"] >= r["clear_at"]
                         and not p["ejected"] and not p.get("probing")), None)
            base = none["ttft_p95_fault"]
            d = 100 * (r["ttft_p95_fault"] / base - 1)
            dw = 100 * (without / base - 1) if without else None
            di = 100 * (r["itl_p95_fault"] / none["itl_p95_fault"] - 1)
            label = "drained by hand" if r["phase"] == "drained" else f"{r['phase']} x{r['factor']:g}"
            deltas.setdefault(label, []).append(d)
            if drained is not None and r is not drained:
                oracle.setdefault(label, []).append(100 * (r["ttft_p95_fault"] / drained["ttft_p95_fault"] - 1))
            names = sorted({x["replica"] for x in during if x.get("replica")} - {r["slow"]})
            peers = "/".join(f"{100 * (share(during, n) or 0):.0f}" for n in names)
            out.append(
                f"| {label} | {seed} | {fmt(r['correction_1_5_s'])} s ({r['peers_peak_correction']:.2f}) "
                f"| {fmt(r['ejected_s'])} s ({', '.join(r['reasons']) or '—'}); {ejections} | {early[0]} / {early[1]} "
                f"| {len(mine)} ({fmt(statistics.median(mine) if mine else None)} s) "
                f"| {fmt(r['share_fault'], True)} / {fmt(r['share_after'], True)} | {peers}% "
                f"| {base:.3f} / {r['ttft_p95_fault']:.3f} s ({d:+.0f}%) "
                f"| {'—' if without is None else f'{without:.3f}'} s ({'—' if dw is None else f'{dw:+.0f}%'}) | {di:+.0f}% "
                f"| {fmt(back)} s | {fmt(r['back_in_s'])} s |")
    out.append("")
    out.append(f"No-fault runs, fleet TTFT p95 over the window: {', '.join(f'{x:.3f}' for x in nofault)} s; "
               f"the replicas' shares there: {', '.join(spread)}.")
    for label, ds in deltas.items():
        against = f"; against the replica drained at the fault's moment: {_med(oracle[label])}" if label in oracle else ""
        out.append(f"{label}: fleet TTFT p95 Δ median {_med(ds)} over {len(ds)} runs{against}.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second, whole fleet")
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds before the fault, of it (+30) and after")
    ap.add_argument("--factor", type=float, default=6.0)
    ap.add_argument("--phases", default="prefill,decode", help="what to slow, in turn: prefill, decode, both; "
                    "drained: the replica drained by hand instead (the reference: capacity lost, nothing slow)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "gray_failure.json"),
                    help="where the runs are saved (figures, requests, the slow replica's state each second)")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the table of saved runs (one file a seed) "
                    "and run nothing")
    ap.add_argument("--port", type=int, default=18400, help="gateway; admin on port + 1")
    ap.add_argument("--sim-port", type=int, default=18500)
    a = ap.parse_args()
    if a.report:
        print(report(a.report))
        return
    work = Path(tempfile.mkdtemp(prefix="gray-"))
    cfg = {"models": [{"name": "glm-5.2", "pools": ["mi355x"]}],
           "pools": [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2", "pricing": MI355X_PRICE,
                      "timing": wall_timing(MI355X_TIMING, 1.0),
                      "replicas": [{"name": f"mi355x-{i}", "url": f"http://127.0.0.1:{a.sim_port + i}"}
                                   for i in range(REPLICAS)]}],
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "admin": {"token_hashes": [hash_key(ADMIN)], "port": a.port + 1},
           "observability": {"log_requests": False},
           # routing as shipped (the load bound on requests in flight at its default; docs/routing.md)
           "timeouts": {"first_byte": 120, "total": 600, "idle": 120}}
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    phases = ["none", *[p for p in a.phases.split(",") if p != "none"]]
    rows = []
    for phase in phases:  # each on fresh simulators and a fresh gateway: caches and learned state start equal
        sim = Proc("sim", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas",
                           str(REPLICAS), "--port", str(a.sim_port), "--stream-interval", "8", "--jitter", "0"],
                   f"http://127.0.0.1:{a.sim_port}/ping", log=work / f"sim-{phase}.log")
        gw = Proc("gateway", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port",
                              str(a.port)], f"http://127.0.0.1:{a.port}/healthz", log=work / f"gateway-{phase}.log")
        try:
            sim.wait_ready()
            gw.wait_ready()
            run = Run(a, f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 1}")
            rows.append(asyncio.run(drive(a, run, phase)))
        finally:
            gw.stop()
            sim.stop()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"Gray failure: 1 of {REPLICAS} simulated MI355X replicas slowed, {a.rate:g} req/s, phases of "
          f"{a.phase_s:g} s (logs: {work})")
    print(table(rows))
    for r in rows[1:]:
        print(f"\n{r['phase']}: /admin/state of {r['slow']} at its highest correction:\n"
              f"{json.dumps(r['peak_state'], indent=None)}\n/metrics ~45 s into the fault:\n{r['metrics_at_peak']}")


if __name__ == "__main__":
    main()
