"""`gateway replay --pd P:D`: a trace on the virtual clock through a prefill/decode-disaggregated fleet, next to a
unified fleet with as many GPUs.

Three runs, each on P + D MI355X TP4 ranks:
- `unified`: P + D unified ranks behind the shipped routing engine (`sim/fleet.py`, as plain `gateway replay`);
- `pd fixed P:D`: every request takes both legs (`decide: always`);
- `pd auto P:D`: the per-request decision (`decide: auto`), the decode ranks prefilling locally when it pays.
The PD runs make the gateway's pair decision (`gateway/routing/pd.py`, the same function `dispatch/pd.py` calls)
with the views the gateway has: a prefix index over prefill ranks (written when a prefill leg succeeds), the
uncached tokens it sent each prefill rank and not yet seen done, the requests in flight per decode rank, and each
decode rank's KV use (what /v1/loads reports). The ranks are the simulator's PD roles (`sim/pd.py`) on one fabric.

Reported per run: TTFT p50/p95 (client-side: + t_api), inter-token latency p95 and p99 (over every generated token:
the gap since the previous step that reached the client, divided by the tokens it carried), prefix hit rate (cached / prompt tokens where the prompt was
computed), the share within the TTFT SLA, goodput (requests per second that met both the TTFT SLA and the ITL target),
and the decision's branch counts.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import PoolTiming, Routing
from gateway.pd_config import Disaggregation
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.recording.trace import TraceRecord
from gateway.routing.pd import DecodeView, PdRequest, PrefillView, choose_decode, decide
from gateway_lab.replay.run import to_job
from gateway_lab.sim.des import EventLoop, VirtualRank
from gateway_lab.sim.fleet import Fleet, Job, mi355x_targets
from gateway_lab.sim.pd import DecodeRank, KvFabric, PrefillRank, Side
from gateway_lab.sim.profiles import ReplicaConfig, profile
from gateway_lab.sim.radix_cache import PrefixCache
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest
from gateway_lab.sim.stats import nearest_rank
from gateway_lab.sim.wafer_groups import WaferGroups


@dataclass
class Done:
    """One request's outcome, whatever the fleet."""

    arrival: float
    prompt: int
    output: int
    branch: str
    cached: int = 0
    ttft: float | None = None
    end: float | None = None


@dataclass
class PdResult:
    label: str
    requests: int
    ttft_p50: float
    ttft_p95: float
    itl_p95_ms: float
    itl_p99_ms: float
    hit_rate: float
    within_sla: float
    goodput: float  # requests per second within both the TTFT SLA and the ITL target
    branches: dict[str, int] = field(default_factory=dict)

    def row(self) -> list[Any]:
        return [self.label, self.requests, f"{self.ttft_p50:.2f}", f"{self.ttft_p95:.2f}", f"{self.itl_p95_ms:.1f}", f"{self.itl_p99_ms:.1f}",
                f"{self.hit_rate * 100:.1f}%", f"{self.within_sla * 100:.1f}%", f"{self.goodput:.2f}",
                ", ".join(f"{k} {v}" for k, v in sorted(self.branches.items(), key=lambda kv: -kv[1]))]


HEADERS = ["run", "requests", "TTFT p50 (s)", "TTFT p95 (s)", "ITL p95 (ms)", "ITL p99 (ms)", "hit", "within TTFT SLA",
           "goodput (req/s)", "branches"]


def markdown(results: Sequence[PdResult]) -> str:
    rows = [HEADERS] + [[str(c) for c in r.row()] for r in results]
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(HEADERS)]
                     + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def summarize(label: str, done: Sequence[Done], gaps: list[tuple[float, int]], sla: float, itl_sla: float,
              span: float) -> PdResult:
    ok = [d for d in done if d.ttft is not None and d.end is not None]
    ttft = sorted(d.ttft for d in ok if d.ttft is not None)
    gaps.sort()
    total = sum(n for _, n in gaps)

    def itl(q: float) -> float:  # weighted by tokens: each token's gap
        seen = 0
        for g, n in gaps:
            seen += n
            if seen >= q * total:
                return g
        return float("nan")

    def good(d: Done) -> bool:
        assert d.ttft is not None and d.end is not None
        decode_s = d.end - d.ttft - d.arrival
        return d.ttft <= sla and (d.output <= 1 or decode_s / (d.output - 1) <= itl_sla)

    branches = Counter(d.branch for d in done)
    return PdResult(label, len(done), nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.95), itl(0.95) * 1000, itl(0.99) * 1000,
                    sum(d.cached for d in ok) / max(1, sum(d.prompt for d in ok)),
                    sum(t <= sla for t in ttft) / max(1, len(ttft)), sum(good(d) for d in ok) / max(span, 1e-9),
                    dict(branches))


def _jobs(trace: Sequence[TraceRecord], routing: Routing, page: int, speed: float
          ) -> Iterator[tuple[float, Callable[[], Job]]]:
    sla = routing.ttft_sla_ms / 1000
    for i, r in enumerate(trace):
        yield r.timestamp_ms / 1000 / speed, functools.partial(to_job, r, i, routing.chunk_tokens, page, sla)


Arrivals = Callable[[], Iterator[tuple[float, Callable[[], Job]]]]  # a fresh iterator per run


def wafer_arrivals(ranks: int, rps: float, duration: float, routing: Routing, seed: int = 0,
                   groups_per_rank: int = 8) -> Arrivals:
    """The Wafer workload (`sim/wafer_groups.py`, as `sim/fleet_wafer.py` runs it), cold: no group is cached at the
    start."""
    pages = PrefixCache(profile("mi355x-glm52-tp4").page_size)
    sla = routing.ttft_sla_ms / 1000

    def arrivals() -> Iterator[tuple[float, Callable[[], Job]]]:  # a fresh draw from `seed` on every run
        workload = WaferGroups(groups_per_rank * ranks, routing.chunk_tokens, seed)
        return workload.arrivals(rps, duration, pages.page_keys, sla, "w")

    return arrivals


def trace_arrivals(trace: Sequence[TraceRecord], routing: Routing, speed: float = 1.0) -> Arrivals:
    return lambda: _jobs(trace, routing, profile("mi355x-glm52-tp4").page_size, speed)


def run_unified(arrivals: Arrivals, ranks: int, routing: Routing,
                progress: Callable[[], None] | None = None) -> tuple[list[Done], list[tuple[float, int]]]:
    gaps: list[tuple[float, int]] = []
    targets = mi355x_targets(ranks)
    fleet = Fleet(targets, routing, itl=gaps)
    fleet.on_arrival = progress
    fleet.feed(arrivals())
    recs = fleet.run()
    return [Done(r.arrival, r.prompt, r.output, r.branch, r.cached, r.ttft, r.end) for r in recs], gaps


class PdFleet:
    """P prefill and D decode ranks on one virtual clock and one KV fabric, routed by `routing/pd.py`."""

    def __init__(self, prefill: int, decode: int, disagg: Disaggregation, routing: Routing,
                 cfg: ReplicaConfig | None = None) -> None:
        self.loop = EventLoop()
        loop = self.loop
        self.fabric = KvFabric(lambda d, fn: loop.at(loop.now + d, fn))
        base = (cfg or profile("mi355x-glm52-tp4")).with_overrides(stream_interval=1)
        self.disagg, self.routing = disagg, routing
        self.timing = PoolTiming()  # what the gateway's decode pool assumes (the defaults: MI355X TP4)
        self.prefill = [VirtualRank(PrefillRank(base.with_overrides(disaggregation_mode="prefill"), i), loop)
                        for i in range(prefill)]
        self.decode = [VirtualRank(DecodeRank(base.with_overrides(
            disaggregation_mode="decode", disaggregation_decode_local_prefill=disagg.local_prefill), i), loop)
            for i in range(decode)]
        for i, p in enumerate(self.prefill):
            self.fabric.register(f"p{i}", p)
        chunks = base.max_total_num_tokens // routing.chunk_tokens
        self.p_index = MemoryPrefixIndex(clock=lambda: loop.now, default_capacity=chunks)
        self.d_index = MemoryPrefixIndex(clock=lambda: loop.now, default_capacity=chunks)
        self.p_queued = [0.0] * prefill
        self.d_inflight = [0] * decode
        self.d_queued = [0.0] * decode
        self.done: list[Done] = []
        self.gaps: list[tuple[float, int]] = []
        self.on_arrival: Callable[[], None] | None = None
        self.t_api = base.timing.t_api
        self._room = 0

    def feed(self, arrivals: Iterator[tuple[float, Callable[[], Job]]]) -> None:
        def next_arrival() -> None:
            item = next(arrivals, None)
            if item is None:
                return
            t, make = item

            def fire() -> None:
                self._arrive(make())
                if self.on_arrival:
                    self.on_arrival()
                next_arrival()

            self.loop.at(t, fire)

        next_arrival()

    def run(self) -> list[Done]:
        self.loop.run()
        return self.done

    # -- the gateway's views ---------------------------------------------------------------------------------
    def _prefill_views(self, hashes: Sequence[int], prompt: int) -> list[PrefillView]:
        names = [f"p{i}" for i in range(len(self.prefill))]
        m = self.p_index.match_sync(hashes, names) if hashes else {}
        return [PrefillView(n, n, 0, min(prompt, m.get(n, 0) * self.routing.chunk_tokens), self.p_queued[i])
                for i, n in enumerate(names)]

    def _decode_views(self, hashes: Sequence[int], prompt: int) -> list[DecodeView]:
        names = [f"d{j}" for j in range(len(self.decode))]
        m = self.d_index.match_sync(hashes, names) if hashes and self.disagg.local_prefill else {}
        out = []
        for j, n in enumerate(names):
            rk = self.decode[j].rank
            assert isinstance(rk, DecodeRank)
            # KV in use, and what the requests in its prealloc queue will reserve
            pending = sum(r.prompt_len + r.output_len for r in rk.prealloc)
            out.append(DecodeView(n, self.d_inflight[j], self.timing.max_running, rk.cfg.max_total_num_tokens,
                                  rk.used_tokens() + pending, self.d_queued[j],
                                  min(prompt, m.get(n, 0) * self.routing.chunk_tokens)))
        return out

    # -- one request -----------------------------------------------------------------------------------------
    def _arrive(self, job: Job) -> None:
        now = self.loop.now
        req = PdRequest(job.prompt_len, max(1, job.output_len), job.req.ttft_sla_s)
        hashes = job.req.hashes
        dviews = self._decode_views(hashes, job.prompt_len)
        picked = choose_decode(dviews, req, self.disagg)
        assert picked is not None
        dview = picked[0]
        j = int(dview.name[1:])
        choice = decide(req, self._prefill_views(hashes, job.prompt_len), dview, self.disagg, self.timing)
        rec = Done(now, job.prompt_len, job.output_len, choice.branch)
        self.done.append(rec)
        d = self.decode[j]
        self.d_inflight[j] += 1
        last = [now]

        def decode_sink(ev: Event) -> None:
            if ev.kind is EventKind.FIRST:
                rec.ttft = ev.time + self.t_api - now
                last[0] = ev.time
                if not choice.disaggregate:
                    rec.cached = dreq.cached
                    self.d_queued[j] -= uncached_local
                    if self.disagg.local_prefill and hashes:
                        self.d_index.insert_sync(f"d{j}", hashes, self.routing.residency_ttl_s)
            elif ev.kind is EventKind.TOKENS and ev.tokens:
                self.gaps.append(((ev.time - last[0]) / ev.tokens, ev.tokens))
                last[0] = ev.time
            elif ev.kind is EventKind.FINISH:
                rec.end = ev.time + self.t_api
                self.d_inflight[j] -= 1
            elif ev.kind is EventKind.ABORT:
                self.d_inflight[j] -= 1

        dreq = SimRequest(job.req.request_id, job.page_keys, job.prompt_len, max(1, job.output_len), "length", now,
                          decode_sink)
        if not choice.disaggregate:
            uncached_local = max(0, job.prompt_len - dview.cached_tokens)
            self.d_queued[j] += uncached_local
            d.rank.submit(dreq)
            d.kick()
            return
        uncached_local = 0
        assert choice.prefill is not None
        i = int(choice.prefill.name[1:])
        p = self.prefill[i]
        uncached = max(0, job.prompt_len - choice.prefill.cached_tokens)
        self.p_queued[i] += uncached

        def prefill_sink(ev: Event) -> None:
            if ev.kind in (EventKind.FINISH, EventKind.ABORT):
                self.p_queued[i] -= uncached
                rec.cached = preq.cached
                if ev.kind is EventKind.FINISH and hashes:
                    self.p_index.insert_sync(f"p{i}", hashes, self.routing.residency_ttl_s)

        preq = SimRequest(job.req.request_id + "-p", job.page_keys, job.prompt_len, 1, "length", now, prefill_sink)
        self._room += 1
        addr = f"p{i}"
        self.fabric.add_prefill(addr, self._room, Side(p.rank, preq, p.kick, lambda: self.loop.now))  # type: ignore[arg-type]
        self.fabric.add_decode(addr, self._room, Side(d.rank, dreq, d.kick, lambda: self.loop.now))  # type: ignore[arg-type]
        p.rank.submit(preq)
        d.rank.submit(dreq)
        p.kick()
        d.kick()


def run_pd(arrivals: Arrivals, prefill: int, decode: int, decide_mode: str, routing: Routing,
           progress: Callable[[], None] | None = None) -> tuple[list[Done], list[tuple[float, int]]]:
    disagg = Disaggregation.model_validate({"prefill": [{"name": f"p{i}", "url": "http://sim"} for i in range(prefill)],
                                            "decide": decide_mode, "local_prefill": decide_mode == "auto"})
    fleet = PdFleet(prefill, decode, disagg, routing)
    fleet.on_arrival = progress
    fleet.feed(arrivals())
    fleet.run()
    return fleet.done, fleet.gaps


def compare(arrivals: Arrivals, span: float, prefill: int, decode: int, routing: Routing, itl_sla_s: float = 0.03,
            progress: Callable[[str], Callable[[], None] | None] | None = None) -> list[PdResult]:
    """The three runs on equal GPU counts, summarized side by side (`span`: seconds of arrivals, for goodput)."""
    sla = routing.ttft_sla_ms / 1000
    out = []
    runs: list[tuple[str, Callable[[Callable[[], None] | None], tuple[list[Done], list[tuple[float, int]]]]]] = [
        (f"unified x{prefill + decode}", lambda cb: run_unified(arrivals, prefill + decode, routing, cb)),
        (f"pd fixed {prefill}:{decode}", lambda cb: run_pd(arrivals, prefill, decode, "always", routing, cb)),
        (f"pd auto {prefill}:{decode}", lambda cb: run_pd(arrivals, prefill, decode, "auto", routing, cb)),
    ]
    for label, fn in runs:
        done, gaps = fn(progress(label) if progress else None)
        out.append(summarize(label, done, gaps, sla, itl_sla_s, span))
    return out
