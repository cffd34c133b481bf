"""The gray failure's routing side on the virtual clock: one replica of four out of routing (as while it is ejected)
under loadtests/gray_failure.py's workload, on the shipped routing engine (gateway_lab/sim/fleet.py), no HTTP and no
slowness: what losing a quarter of the capacity costs the fleet's TTFT p95 however fast the slow replica is found,
how evenly its prompt groups land on its peers, and how fast it gets its share back.

    .venv/bin/python -m loadtests.gray_des --seeds 0-15 --factors 0,2

Per seed and `load_bound_factor`: the no-fault run and the run with the last replica out of routing from `--out-at`
to `--back-at` (the gray-failure runs' ejection: 11 s into a fault at 60 s until 24 s after its clear at 180 s);
TTFT p95 over the gray-failure runs' window (30 s into the fault to its clear), the replicas' shares there, and the
returned replica's share over the last 20 s.

Across arrival rates (`--rates`), per rate over the seeds: the no-fault run; the oracle, the last replica out of
routing from the fault's start to its clear (nothing slow: the capacity lost, found at once); and the gateway's own
runs, the replica's prefill or decode forwards `--slow` times slower from the fault to the clear, found (or not) by
the gateway's latency outlier detection (dispatch/outliers.py and its probe gate, fed what dispatch feedback feeds
it). With each replica's utilisation (busy time of its forwards) over the window:

    .venv/bin/python -m loadtests.gray_des --rates 2,3,4,5,6 --seeds 0-15
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gateway.config import OutlierDetection, Routing
from gateway.dispatch.outliers import LatencyOutliers, detector_stats
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.hashing import chain, group_key
from gateway.probe_gate import ProbeGate
from gateway.routing.decision import Decision
from gateway.routing.engine import Attempt, Effect, RoutingEngine
from gateway.routing.request import RoutingRequest
from gateway_lab.sim.fleet import CHUNK, Fleet, Instance, Job, Record, mi355x_targets
from gateway_lab.sim.sim_request import Step

REPLICAS, GROUPS, PREFIX, PROMPT, OUTPUT = 4, 16, 2000, 4000, 64
FAULT, CLEAR, END = 60.0, 180.0, 270.0


class _State:
    """What the outlier detector reads and writes of a target (gateway/upstreams.py's TargetState, in part)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.ejected = False
        self.probe = ProbeGate(clock=clock)


class _Target:
    def __init__(self, name: str, pool: str, clock: Callable[[], float]) -> None:
        self.name, self.pool, self.state = name, pool, _State(clock)

    def routable(self, probe: bool = True) -> bool:
        return not self.state.ejected and (not probe or self.state.probe.available())


class PartialFleet(Fleet):
    """The fleet with its last replica out of routing (not a candidate) between two moments (the oracle: nothing
    slow); or, with `fault`, its prefill or decode forwards `factor` times slower between two moments, judged by the
    gateway's latency outlier detection (dispatch/outliers.py with its probe gate, fed as dispatch/feedback.py feeds
    it: the TTFT residual against the pool's prediction at the first token, the stream's mean inter-token latency at
    its end). Each rank's busy time inside `window` is summed (its utilisation there)."""

    def __init__(self, *a: Any, out: str, out_at: float, back_at: float, fault: str = "",
                 factor: float = 6.0, window: tuple[float, float] = (FAULT + 30, CLEAR),
                 detection: OutlierDetection | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.out, self.out_at, self.back_at = out, out_at, back_at
        clock = lambda: self.loop.now  # noqa: E731
        self.busy = {name: 0.0 for name in self.ranks}
        for name, vr in self.ranks.items():
            vr._done = self._timed(name, vr._done, window)  # type: ignore[method-assign,assignment]
        self.targets = {i.name: _Target(i.name, i.pool, clock) for i in self.infos}
        self.ejected_at: list[float] = []  # each ejection of `out` (virtual seconds)
        self.reasons: list[str] = []  # and why (latency_ttft | latency_itl)
        self.outliers: LatencyOutliers | None = None
        if fault:
            rank = self.ranks[out].rank

            def slow(prefill: float, decode: float) -> None:  # the simulator's /_sim/fault {"kind": "slow"}
                rank.prefill_slow, rank.decode_slow = prefill, decode

            self.loop.at(out_at, lambda: slow(factor, 1.0) if fault == "prefill" else slow(1.0, factor))
            self.loop.at(back_at, lambda: slow(1.0, 1.0))
            self.out_at = self.back_at = 1e18  # not taken out by hand: only the detector takes it out
            od = detection or OutlierDetection()
            pools: dict[str, list[_Target]] = {}
            for t in self.targets.values():
                pools.setdefault(t.pool, []).append(t)
            self.outliers = LatencyOutliers(od, detector_stats(od, clock), lambda: pools,
                                            corrector=self.instances[0].engine.corrector, clock=clock)
            self._feedback(self.instances[0].engine, self.outliers)

    def _timed(self, name: str, done: Callable[[Step], None], window: tuple[float, float]) -> Callable[[Step], None]:
        def timed(step: Step) -> None:
            end = self.loop.now
            self.busy[name] += max(0.0, min(end, window[1]) - max(end - step.duration, window[0]))
            done(step)
        return timed

    def _feedback(self, eng: RoutingEngine, od: LatencyOutliers) -> None:
        """The engine's feedback calls, with what dispatch/feedback.py and the dispatcher add for the detector."""
        dispatched, first_token, finished = eng.dispatched, eng.first_token, eng.finished
        firsts: dict[str, float] = {}

        def judged() -> None:
            od.tick()
            if self.out in od.ejections and (not self.ejected_at or od.ejections[self.out].since > self.ejected_at[-1]):
                self.ejected_at.append(od.ejections[self.out].since)
                self.reasons.append(od.ejections[self.out].reason)

        def on_dispatched(a: Attempt) -> list[Effect]:
            self.targets[a.name].state.probe.acquire(a.req.request_id)  # routing offered it only with its slot free
            return dispatched(a)

        def on_first(a: Attempt, observed: float | None) -> list[Effect]:
            out = first_token(a, observed)
            firsts[a.req.request_id] = self.loop.now
            if observed is not None and a.ttft_raw > 0:
                od.stats.ttft(a.name, observed, a.ttft_raw * eng.corrector.get(a.pool, a.regime))
                judged()
            return out

        def on_finished(a: Attempt, failed: bool = False) -> list[Effect]:
            first = firsts.pop(a.req.request_id, None)
            if first is not None and OUTPUT > 1:
                od.stats.itl(a.name, (self.loop.now - first) / (OUTPUT - 1))
                judged()
            out = finished(a, failed)
            od.attempt_ended(a.name, a.req.request_id)
            return out

        eng.dispatched, eng.first_token, eng.finished = on_dispatched, on_first, on_finished  # type: ignore[method-assign,assignment]

    def _decide(self, inst: Instance, job: Job, req: RoutingRequest | None = None) -> Decision[Any]:
        every = self.infos
        gone = self.out_at <= self.loop.now < self.back_at
        self.infos = [i for i in every if not (gone and i.name == self.out) and self.targets[i.name].routable()]
        try:
            return super()._decide(inst, job, req)
        finally:
            self.infos = every


def run(seed: int, factor: float, out_at: float, back_at: float, rate: float) -> list[Record]:
    return simulate(seed, factor, out_at, back_at, rate).records


def simulate(seed: int, factor: float, out_at: float, back_at: float, rate: float, fault: str = "",
             slow: float = 6.0, detection: OutlierDetection | None = None) -> PartialFleet:
    """One run; `fault` (prefill | decode): the last replica `slow` times slower from `out_at` to `back_at` and the
    outlier detector on, instead of the replica out of routing then."""
    routing = Routing.model_validate({"policy": {"type": "prefix_sla_cost", "load_bound_factor": factor},
                                      "chunk_tokens": CHUNK})
    fleet = PartialFleet(mi355x_targets(REPLICAS), routing, 1, True, seed,
                         corrector=lambda: TtftCorrector(z=routing.ttft_quantile_z),
                         out=f"mi355x-{REPLICAS - 1}", out_at=out_at, back_at=back_at, fault=fault, factor=slow,
                         detection=detection)
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    prefixes = [nrng.integers(0, 150_000, PREFIX, dtype=np.uint32) for _ in range(GROUPS)]
    salt = b"glm-5.2\x00tenant"
    hashes = [chain(salt, [p[k * CHUNK:(k + 1) * CHUNK].tobytes() for k in range(PREFIX // CHUNK)]) for p in prefixes]
    page_keys = fleet.ranks["mi355x-0"].rank.cache.page_keys

    def arrivals() -> Iterator[tuple[float, Callable[[], Job]]]:
        t, i = 0.0, 0
        while (t := t + rng.expovariate(rate)) <= END:
            g = rng.randrange(GROUPS)

            def make(g: int = g, i: int = i) -> Job:
                tokens = np.concatenate([prefixes[g], nrng.integers(0, 150_000, PROMPT - PREFIX, dtype=np.uint32)])
                own = nrng.integers(-2**63, 2**63 - 1, PROMPT // CHUNK - len(hashes[g]), dtype=np.int64)
                h = tuple(hashes[g]) + tuple(int(x) for x in own)
                req = RoutingRequest(f"r{i}", "tenant", "glm-5.2", "chat/completions", True, PROMPT, OUTPUT, h, 2.22,
                                     "cost", "spill", group_key(h, i))
                return Job(req, page_keys(tokens, "tenant"), PROMPT, OUTPUT)

            yield t, make
            i += 1

    fleet.feed(arrivals())
    fleet.run()
    return fleet


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))]


def figures(recs: list[Record]) -> tuple[float, list[float], float]:
    w = [r for r in recs if FAULT + 30 <= r.arrival < CLEAR and r.ttft is not None]
    shares = [sum(r.name == f"mi355x-{i}" for r in w) / len(w) for i in range(REPLICAS)]
    last = [r for r in recs if r.arrival >= END - 20]
    return p95([r.ttft for r in w if r.ttft is not None]), shares, \
        sum(r.name == f"mi355x-{REPLICAS - 1}" for r in last) / max(1, len(last))


def seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if hi else [int(x) for x in text.split(",")]


def pct(xs: list[float]) -> str:
    return "/".join(f"{100 * x:.0f}" for x in xs)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.0f}% [{min(xs):+.0f}, {max(xs):+.0f}]"


def _tail(f: PartialFleet) -> tuple[float, float]:
    """Of the window's requests: those that waited (TTFT over 1.2x what they take alone on an idle replica with what
    it held of them: queued behind another's prefill), and those that found none of their prompt cached."""
    w = [(r.ttft, r.idle_ttft, r.cached) for r in f.records
         if FAULT + 30 <= r.arrival < CLEAR and r.ttft is not None and r.idle_ttft is not None]
    return sum(t > 1.2 * idle for t, idle, _ in w) / len(w), sum(c == 0 for _, _, c in w) / len(w)


def sweep(rates: list[float], seeds_: list[int], factor: float, slow: float, per_seed: bool,
          detection: OutlierDetection | None = None) -> None:
    """Per arrival rate over the seeds: the no-fault run, the oracle (the last replica out of routing from the fault's
    start to its clear, nothing slow: the capacity lost, found at once) and the gateway's own runs (prefill, then
    decode, `slow` times slower, found by its outlier detection), over the gray-failure runs' window."""
    logging.getLogger("gateway.outliers").setLevel(logging.ERROR)  # its ejection lines: counted below instead
    span = CLEAR - FAULT - 30
    last = f"mi355x-{REPLICAS - 1}"
    cap: list[str] = []
    gw: list[str] = []
    for rate in rates:
        res: dict[str, list[tuple[float, PartialFleet]]] = {}
        for s in seeds_:
            for mode in ("none", "oracle", "prefill", "decode"):
                fault = mode if mode in ("prefill", "decode") else ""
                at, back = (FAULT, CLEAR) if mode != "none" else (1e9, 1e9)
                f = simulate(s, factor, at, back, rate, fault, slow, detection)
                res.setdefault(mode, []).append((figures(f.records)[0], f))
        base = [p for p, _ in res["none"]]

        def util(mode: str, names: list[str], res: dict[str, list[tuple[float, PartialFleet]]] = res) -> float:
            return statistics.mean(f.busy[n] / span for _, f in res[mode] for n in names)

        peers = [f"mi355x-{i}" for i in range(REPLICAS - 1)]
        allr = [*peers, last]
        top = max(f.busy[n] / span for _, f in res["none"] for n in allr)
        d_or = [100 * (o / b - 1) for (o, _), b in zip(res["oracle"], base, strict=True)]
        ok = sum(d <= 10 for d in d_or)
        tail = [[100 * statistics.mean(_tail(f)[k] for _, f in res[mode]) for k in (0, 1)] for mode in ("none", "oracle")]
        cap.append(f"| {rate:g} | {util('none', allr):.2f} (max {top:.2f}) | {util('oracle', peers):.2f} "
                   f"| {tail[0][0]:.1f} / {tail[0][1]:.1f}% | {tail[1][0]:.1f} / {tail[1][1]:.1f}% "
                   f"| {statistics.mean(base):.3f} | {statistics.mean(p for p, _ in res['oracle']):.3f} "
                   f"| {_spread(d_or)} | {ok}/{len(base)} |")
        for mode in ("prefill", "decode"):
            ps = [p for p, _ in res[mode]]
            d_nf = [100 * (p / b - 1) for p, b in zip(ps, base, strict=True)]
            d_oc = [100 * (p / o - 1) for p, (o, _) in zip(ps, res["oracle"], strict=True)]
            ej = [f.ejected_at[0] - FAULT for _, f in res[mode] if f.ejected_at]
            mine = [sum(r.name == last and FAULT + 30 <= r.arrival < CLEAR for r in f.records) for _, f in res[mode]]
            gw.append(f"| {rate:g} | {mode} x{slow:g} | {_med(ej)} s ({len(ej)}/{len(ps)}) "
                      f"| {statistics.mean(len(f.ejected_at) for _, f in res[mode]):.1f} | {statistics.mean(mine):.1f} "
                      f"| {util(mode, peers):.2f} | {statistics.mean(ps):.3f} | {_spread(d_nf)} "
                      f"| {sum(d <= 10 for d in d_nf)}/{len(ps)} | {_spread(d_oc)} |")
            if per_seed:
                for s, p, b, (o, _), (_, f) in zip(seeds_, ps, base, res["oracle"], res[mode], strict=True):
                    print(f"rate {rate:g} seed {s} {mode}: no-fault {b:.3f} oracle {o:.3f} gateway {p:.3f} s; "
                          f"ejected at [{', '.join(f'{x - FAULT:.1f}' for x in f.ejected_at)}]", flush=True)
        print(f"rate {rate:g} done", flush=True)
    print(f"\nSeeds {seeds_[0]}-{seeds_[-1]} ({len(seeds_)}), load_bound_factor {factor:g}; window {FAULT + 30:g}-{CLEAR:g} s "
          f"(fault at {FAULT:g} s, clear at {CLEAR:g} s).\n")
    print("| req/s | utilisation no-fault: mean of 4 (max) | utilisation oracle: mean of 3 | no-fault: waited / "
          "missed the prefix | oracle: waited / missed | TTFT p95 no-fault (mean) | TTFT p95 oracle one out (mean) "
          "| oracle Δ: median [range] | oracle within 10% |\n"
          "|---|---|---|---|---|---|---|---|---|")
    print("\n".join(cap))
    print("\n| req/s | slowed | first ejected after: median (runs) | ejections in the fault (mean) | its requests in "
          "the window (mean) | utilisation of its peers | TTFT p95 (mean) | Δ vs no-fault: median [range] "
          "| within 10% | Δ vs oracle: median [range] |\n|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(gw))


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]" if xs else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-4", help="0-7 or 0,3,5")
    ap.add_argument("--factors", default="0,2", help="load_bound_factor values (0: off; 2: the default)")
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second, whole fleet")
    ap.add_argument("--out-at", type=float, default=FAULT + 11)
    ap.add_argument("--back-at", type=float, default=CLEAR + 24)
    ap.add_argument("--rates", help="sweep these arrival rates (e.g. 2,3,4,5,6): the no-fault run, the oracle (the "
                    "replica out from the fault's start to its clear) and the gateway's runs with it slowed")
    ap.add_argument("--slow", type=float, default=6.0, help="with --rates: the slowed replica's factor")
    ap.add_argument("--per-seed", action="store_true", help="with --rates: a line per seed and fault too")
    ap.add_argument("--outlier", default="", help="with --rates: outlier_detection settings other than the "
                    "defaults, e.g. window_s=60")
    a = ap.parse_args()
    if a.rates:
        od = OutlierDetection.model_validate(dict(kv.split("=") for kv in a.outlier.split(",")) if a.outlier else {})
        sweep([float(x) for x in a.rates.split(",")], seeds(a.seeds), float(a.factors.split(",")[-1]), a.slow,
              a.per_seed, od)
        return
    print("| load_bound_factor | seed | TTFT p95: no-fault / one out (Δ) | shares no-fault | shares one out "
          "| its share, last 20 s |\n|---|---|---|---|---|---|")
    summary = []
    for factor in (float(x) for x in a.factors.split(",")):
        rows = []
        for s in seeds(a.seeds):
            base, calm, _ = figures(run(s, factor, 1e9, 1e9, a.rate))
            out, shares, after = figures(run(s, factor, a.out_at, a.back_at, a.rate))
            rows.append((base, out, after))
            print(f"| {factor:g} | {s} | {base:.3f} / {out:.3f} s ({100 * (out / base - 1):+.0f}%) | {pct(calm)}% "
                  f"| {pct(shares)}% | {100 * after:.0f}% |", flush=True)
        ds = [100 * (o / b - 1) for b, o, _ in rows]
        summary.append(f"load_bound_factor {factor:g}: TTFT p95 no-fault mean {statistics.mean(b for b, _, _ in rows):.3f} s, "
                       f"one out {statistics.mean(o for _, o, _ in rows):.3f} s; Δ median {statistics.median(ds):+.0f}% "
                       f"[{min(ds):+.0f}%, {max(ds):+.0f}%]; its share over the last 20 s mean "
                       f"{100 * statistics.mean(x for _, _, x in rows):.0f}% (fair: {100 / REPLICAS:.0f}%)")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
