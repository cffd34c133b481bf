"""The gray failure's routing side on the virtual clock: one replica of four out of routing (as while it is ejected)
under loadtests/gray_failure.py's workload, on the shipped routing engine (gateway_lab/sim/fleet.py), no HTTP and no
slowness: what losing a quarter of the capacity costs the fleet's TTFT p95 however fast the slow replica is found,
how evenly its prompt groups land on its peers, and how fast it gets its share back.

    .venv/bin/python -m loadtests.gray_des --seeds 0-15 --factors 0,2

Per seed and `load_bound_factor`: the no-fault run and the run with the last replica out of routing from `--out-at`
to `--back-at` (the gray-failure runs' ejection: 11 s into a fault at 60 s until 24 s after its clear at 180 s);
TTFT p95 over the gray-failure runs' window (30 s into the fault to its clear), the replicas' shares there, and the
returned replica's share over the last 20 s.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gateway.config import Routing
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.hashing import chain, group_key
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway_lab.sim.fleet import CHUNK, Fleet, Instance, Job, Record, mi355x_targets

REPLICAS, GROUPS, PREFIX, PROMPT, OUTPUT = 4, 16, 2000, 4000, 64
FAULT, CLEAR, END = 60.0, 180.0, 270.0


class PartialFleet(Fleet):
    """The fleet with one replica out of routing (not a candidate) between two moments."""

    def __init__(self, *a: Any, out: str, out_at: float, back_at: float, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.out, self.out_at, self.back_at = out, out_at, back_at

    def _decide(self, inst: Instance, job: Job, req: RoutingRequest | None = None) -> Decision[Any]:
        every = self.infos
        if self.out_at <= self.loop.now < self.back_at:
            self.infos = [i for i in every if i.name != self.out]
        try:
            return super()._decide(inst, job, req)
        finally:
            self.infos = every


def run(seed: int, factor: float, out_at: float, back_at: float, rate: float) -> list[Record]:
    routing = Routing.model_validate({"policy": {"type": "prefix_sla_cost", "load_bound_factor": factor},
                                      "chunk_tokens": CHUNK})
    fleet = PartialFleet(mi355x_targets(REPLICAS), routing, 1, True, seed,
                         corrector=lambda: TtftCorrector(z=routing.ttft_quantile_z),
                         out=f"mi355x-{REPLICAS - 1}", out_at=out_at, back_at=back_at)
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
    return fleet.run()


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-4", help="0-7 or 0,3,5")
    ap.add_argument("--factors", default="0,2", help="load_bound_factor values (0: off; 2: the default)")
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second, whole fleet")
    ap.add_argument("--out-at", type=float, default=FAULT + 11)
    ap.add_argument("--back-at", type=float, default=CLEAR + 24)
    a = ap.parse_args()
    print("| load_bound_factor | seed | TTFT p95: no-fault / one out (Δ) | shares no-fault | shares one out "
          "| its share, last 20 s |\n|---|---|---|---|---|---|")
    summary = []
    for factor in (float(x) for x in a.factors.split(",")):
        rows = []
        for s in seeds(a.seeds):
            base, calm, _ = figures(run(s, factor, 1e9, 1e9, a.rate))
            out, shares, after = figures(run(s, factor, a.out_at, a.back_at, a.rate))
            rows.append((base, out, after))
            pct = lambda xs: "/".join(f"{100 * x:.0f}" for x in xs)  # noqa: E731
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
