"""Multi-tenant traces: a mixer that gives each request a tenant and replays traces together, and the noisy-neighbour
scenario run through the shipped flow controller (gateway/flow/) on the virtual clock.

    gateway replay VICTIM.jsonl --noisy AGGRESSOR.jsonl --nodes 4 [--aggressor-x 5] [--window-s 1200]

Tenant B (the victim) replays its trace as recorded; tenant A (the aggressor) is sped up until its demand is
`aggressor_x` times its weighted share. A tenant's demand is in flow control's own unit, prefill-weighted tokens
per second: prompt tokens the trace's ideal cache cannot hold at `prefill_weight`, the ones it can at
`cached_weight`, output tokens at `output_weight`. Shares are relative to B: B "at its share" means the fleet is
sized so that B's trace is its weighted share of it (twice the fleet that serves B alone within its SLA, for two
tenants of equal weight), so A at 5x its share is at 5x B's demand.

Per run and tenant: requests, within SLA (of every request it sent: a refusal is not within; and of those that could
meet it at all, i.e. whose TTFT alone on an idle replica holding their cached prefix is within it, a refused request
counted as possible), TTFT p95 of those served, refusals by reason, goodput (prompt + output tokens per second of requests within their SLA, over the
arrival window, in flow control's unit: uncached prompt tokens at `prefill_weight`, cached ones at `cached_weight`,
output tokens at `output_weight`). Fairness is Jain's index over the tenants' goodput normalised by their weighted max-min fair share
of the run's total goodput (a tenant asking for less than its share is owed what it asked for).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.config import Routing
from gateway.flow.settings import Band, FlowControl, FlowPolicy
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway.routing.features import TargetInfo
from gateway.upstreams import DEFAULT_PRIORITY_VALUES
from gateway_lab.replay.bounds import ideal_hit_rate
from gateway_lab.replay.run import to_job
from gateway_lab.sim.fleet import Fleet, Job, Record, idle_ttft
from gateway_lab.sim.profiles import ReplicaConfig
from gateway_lab.sim.stats import nearest_rank

TENANT_ID_SHIFT = 40  # block ids of tenant k are offset by k << 40: tenants never share KV (isolated caches)


@dataclass(frozen=True)
class Part:
    trace: Sequence[TraceRecord]
    tenant: int  # the replayed request's tenant is "tenant-<n>"
    speed: float = 1.0  # arrivals compressed this many times


def tenant_name(n: int) -> str:
    return f"tenant-{n}"  # as run.to_job names them


def mix(parts: Sequence[Part], window_s: float | None = None) -> list[TraceRecord]:
    """The parts' requests in one arrival order, each with its part's tenant, block ids made distinct per tenant,
    arrivals after `window_s` dropped."""
    out = []
    for p in parts:
        off = p.tenant << TENANT_ID_SHIFT
        for r in p.trace:
            ts = r.timestamp_ms / p.speed
            if window_s is not None and ts > window_s * 1000:
                break
            out.append(replace(r, timestamp_ms=ts, tenant=p.tenant, hash_ids=tuple(h + off for h in r.hash_ids)))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def units(cfg: FlowControl, prompt: int, cached: int, output: int) -> float:
    """One request in flow control's unit, prefill-weighted tokens: its uncached prompt at `prefill_weight`, its
    cached prefix at `cached_weight`, its output at `output_weight` (docs/flow-control.md)."""
    return (prompt - cached) * cfg.prefill_weight + cached * cfg.cached_weight + output * cfg.output_weight


def demand(trace: Sequence[TraceRecord], cfg: FlowControl, window_s: float | None = None) -> float:
    """Prefill-weighted tokens per second the trace asks for (at its ideal hit rate), over its span or the window."""
    if not trace:
        return 0.0
    span = window_s or max(trace[-1].timestamp_ms / 1000, 1e-9)
    recs = [r for r in trace if r.timestamp_ms <= span * 1000]
    hit = ideal_hit_rate(recs)
    prompt = sum(r.input_length for r in recs)
    out = sum(r.output_length for r in recs)
    return (prompt * (1 - hit) * cfg.prefill_weight + prompt * hit * cfg.cached_weight + out * cfg.output_weight) / span


def possible_demand(trace: Sequence[TraceRecord], cfg: FlowControl, rank: ReplicaConfig, sla_s: float,
                    window_s: float | None = None) -> float:
    """`demand` of the requests that can meet the SLA at all: each request's cached prefix is what the trace's ideal
    cache holds of it (its leading blocks seen before), and it counts when its TTFT alone on an idle rank holding
    that prefix is within `sla_s` — the requests the "of those possible" columns count. A tenant is owed no
    goodput for a request no fleet of these ranks can serve within its SLA, so fairness is read on this demand too."""
    if not trace:
        return 0.0
    span = window_s or max(trace[-1].timestamp_ms / 1000, 1e-9)
    seen: set[int] = set()
    owed = 0.0
    for r in trace:
        if r.timestamp_ms > span * 1000:
            continue
        cached = 0
        for h in r.hash_ids[: r.input_length // BLOCK_TOKENS]:
            if h not in seen:
                break
            cached += BLOCK_TOKENS
        seen.update(r.hash_ids)
        if idle_ttft(rank, r.input_length, cached) <= sla_s:
            owed += units(cfg, r.input_length, cached, r.output_length)
    return owed / span


def jain_of(goodput: dict[str, float], demands: dict[str, float], weights: dict[str, float]) -> float:
    """Jain's index over the tenants' goodput normalised by their weighted max-min fair share of the total goodput
    (a tenant asking for less than its share is owed what it asked for)."""
    fair = fair_shares(sum(goodput.values()), demands, weights)
    return jain([goodput[t] / fair[t] for t in goodput if fair[t] > 0])


@dataclass
class TenantRow:
    tenant: str
    requests: int
    within_sla: float
    within_sla_possible: float  # of the requests that could meet the SLA at all (alone on an idle replica)
    ttft_p95: float
    refused: dict[str, int]
    goodput: float  # units/s of requests within SLA
    served: float  # units/s of requests that began (a first token) within the window, late or not
    demand: float  # tokens/s asked for
    queued_p95: float
    preempted: int = 0  # requests cancelled before their first token and queued again (each served or refused)


@dataclass
class MixResult:
    label: str
    tenants: list[TenantRow]
    goodput: float
    jain: float
    lost: int  # requests with neither an answer nor a refusal (must be 0)
    extra: dict[str, Any] = field(default_factory=dict)
    jain_possible: float | None = None  # the same index on each tenant's demand that can meet its SLA at all

    def rows(self) -> list[list[Any]]:
        return [[self.label, t.tenant, t.requests, f"{t.within_sla * 100:.1f}%",
                 f"{t.within_sla_possible * 100:.1f}%", f"{t.ttft_p95:.2f}",
                 f"{t.queued_p95:.2f}", _refusals(t.refused), f"{t.goodput / 1000:.1f}k", f"{t.served / 1000:.1f}k",
                 f"{t.demand / 1000:.1f}k", f"{self.goodput / 1000:.1f}k",
                 f"{self.jain:.3f}", "—" if self.jain_possible is None else f"{self.jain_possible:.3f}",
                 t.preempted, self.lost] for t in self.tenants]


HEADERS = ["run", "tenant", "requests", "within SLA", "of those possible", "TTFT p95", "queued p95", "refused", "goodput",
           "served", "demand", "fleet goodput", "Jain", "Jain, of those possible", "preempted", "lost"]


def _refusals(by: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items())) or "0"


def jain(xs: Sequence[float]) -> float:
    xs = [x for x in xs]
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else 1.0


def fair_shares(total: float, demands: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair split of `total`: a tenant asking for less than its weighted share gets what it asked
    for, the rest is split by weight among the others (water-filling)."""
    share: dict[str, float] = {}
    left, active = total, dict(demands)
    while active and left > 1e-9:
        w = sum(weights[t] for t in active)
        capped = {t: d for t, d in active.items() if d - share.get(t, 0.0) <= left * weights[t] / w}
        if not capped:
            for t in active:
                share[t] = share.get(t, 0.0) + left * weights[t] / w
            break
        for t, d in capped.items():
            left -= d - share.get(t, 0.0)
            share[t] = d
            del active[t]
    return {t: share.get(t, 0.0) for t in demands}


def summarize(label: str, recs: Sequence[Record], sla: dict[str, float], window_s: float,
              demands: dict[str, float], weights: dict[str, float], sent: dict[str, int], cfg: FlowControl,
              can_meet: dict[str, float] | None = None) -> MixResult:
    def unit(r: Record) -> float:
        return units(cfg, r.prompt, r.cached, r.output)

    rows = []
    for tenant in sorted(demands):
        mine = [r for r in recs if r.tenant == tenant]
        served = sorted(r.ttft for r in mine if r.ttft is not None)
        ok = [r for r in mine if r.ttft is not None and r.ttft <= sla[tenant]]
        refused: dict[str, int] = {}
        for r in mine:
            if r.refused or not r.name:
                refused[r.refused or r.branch] = refused.get(r.refused or r.branch, 0) + 1
        possible = [r for r in mine if r.idle_ttft is None or r.idle_ttft <= sla[tenant]]
        ok_possible = [r for r in ok if r.idle_ttft is None or r.idle_ttft <= sla[tenant]]
        rows.append(TenantRow(tenant, len(mine), len(ok) / max(1, len(mine)),
                              len(ok_possible) / max(1, len(possible)), nearest_rank(served, 0.95),
                              refused, sum(unit(r) for r in ok) / window_s,
                              sum(unit(r) for r in mine if r.ttft is not None and r.arrival + r.ttft <= window_s)
                              / window_s, demands[tenant],
                              nearest_rank(sorted(r.queued_s for r in mine if r.name), 0.95),
                              sum(1 for r in mine if r.preempted)))
    total = sum(t.goodput for t in rows)
    goodput = {t.tenant: t.goodput for t in rows}
    j = jain_of(goodput, {t.tenant: t.demand for t in rows}, weights)
    jp = jain_of(goodput, {t: can_meet[t] for t in goodput}, weights) if can_meet else None
    answered = sum(1 for r in recs if r.ttft is not None or r.refused or not r.name)
    return MixResult(label, rows, total, j, sum(sent.values()) - answered, jain_possible=jp)


def run_mix(trace: Sequence[TraceRecord], targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing,
            flow: FlowControl | None, policies: dict[str, FlowPolicy], sla_s: dict[str, float], label: str,
            window_s: float, demands: dict[str, float], instances: int = 1,
            progress: Callable[[], None] | None = None, priority: dict[str, int] | None = None,
            preempt: bool = False, can_meet: dict[str, float] | None = None) -> MixResult:
    """Replay a mixed trace (each tenant its SLA) with or without flow control, and summarize it per tenant.
    `priority`: the tenants' engine priority classes (PRIORITY_VALUES), the same with or without flow control."""
    fleet = Fleet(targets, routing, instances, True, flow=flow, flow_tenants=policies, tenant_priority=priority,
                  preempt=preempt)
    fleet.on_arrival = progress
    page = targets[0][1].page_size
    default_sla = routing.ttft_sla_ms / 1000

    def arrivals() -> Iterator[tuple[float, Callable[[], Job]]]:
        for i, r in enumerate(trace):
            sla = sla_s.get(tenant_name(r.tenant), default_sla)
            yield r.timestamp_ms / 1000, functools.partial(to_job, r, i, routing.chunk_tokens, page, sla)

    fleet.feed(arrivals())
    recs = fleet.run()
    sent: dict[str, int] = {}
    for r in trace:
        sent[tenant_name(r.tenant)] = sent.get(tenant_name(r.tenant), 0) + 1
    weights = {t: policies.get(t, FlowPolicy()).weight for t in demands}
    return summarize(label, recs, {t: sla_s.get(t, default_sla) for t in demands}, window_s, demands, weights, sent,
                     flow or FlowControl(), can_meet)


def noisy_neighbour(victim: Sequence[TraceRecord], aggressor: Sequence[TraceRecord],
                    targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing, flow: FlowControl,
                    aggressor_x: float = 5.0, window_s: float = 1200.0, weights: tuple[float, float] = (1.0, 1.0),
                    progress: Callable[[str, int], Callable[[], None] | None] | None = None,
                    instances: int = 1) -> list[MixResult]:
    """B (tenant-1, the victim) at its share, A (tenant-2) at `aggressor_x` x its weighted share: B alone, A alone,
    both without flow control, both with it — one table. `instances`: gateway instances, requests dealt round-robin
    (each its own queue, the fair tags and the routing state shared, as over Redis)."""
    b_demand = demand(victim, flow, window_s)
    a_unit = demand(aggressor, flow)  # at speed 1
    a_speed = aggressor_x * b_demand * (weights[1] / weights[0]) / a_unit
    b_part, a_part = Part(victim, 1), Part(aggressor, 2, a_speed)
    on = flow.model_copy(update={"enabled": True})
    pol = {tenant_name(1): FlowPolicy(weight=weights[0]), tenant_name(2): FlowPolicy(weight=weights[1])}
    sla = {tenant_name(1): routing.ttft_sla_ms / 1000, tenant_name(2): routing.ttft_sla_ms / 1000}
    both = mix([b_part, a_part], window_s)
    only_b, only_a = mix([b_part], window_s), mix([a_part], window_s)
    dem = {tenant_name(1): b_demand, tenant_name(2): demand(only_a, flow, window_s)}
    rank = targets[0][1]
    can = {tenant_name(1): possible_demand(only_b, flow, rank, sla[tenant_name(1)], window_s),
           tenant_name(2): possible_demand(only_a, flow, rank, sla[tenant_name(2)], window_s)}
    runs: list[tuple[str, list[TraceRecord], FlowControl | None, list[str]]] = [
        ("B alone", only_b, on, [tenant_name(1)]),
        ("A alone", only_a, on, [tenant_name(2)]),
        ("A+B, no flow control", both, None, list(dem)),
        ("A+B, flow control", both, on, list(dem)),
    ]
    out = []
    for label, trace, fc, who in runs:
        cb = progress(label, len(trace)) if progress else None
        out.append(run_mix(trace, targets, routing, fc, pol, sla, label, window_s, {t: dem[t] for t in who},
                           instances, progress=cb, can_meet={t: can[t] for t in who}))
    out[-1].extra = {"aggressor_speed": a_speed, "b_demand": b_demand, "a_demand": dem[tenant_name(2)],
                     "b_possible": can[tenant_name(1)], "a_possible": can[tenant_name(2)]}
    return out


BANDS = ("critical", "standard", "sheddable")


def split_bands(trace: Sequence[TraceRecord], speed: float) -> list[TraceRecord]:
    """The trace as three tenants of equal size, one per default band: a conversation (its first block after the
    shared system prompt) stays with one tenant, so each keeps its prefix reuse."""
    out = []
    for r in trace:
        k = 1 + (r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0] if r.hash_ids else 0) % 3
        off = k << TENANT_ID_SHIFT
        out.append(replace(r, timestamp_ms=r.timestamp_ms / speed, tenant=k, hash_ids=tuple(h + off for h in r.hash_ids)))
    return out


def priority_bands(trace: Sequence[TraceRecord], targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]],
                   routing: Routing, flow: FlowControl, speed: float, window_s: float,
                   progress: Callable[[str, int], Callable[[], None] | None] | None = None,
                   bands: list[Band] | None = None) -> list[MixResult]:
    """Three tenants (tenant-1 critical, tenant-2 standard, tenant-3 sheddable) sharing the trace sped up `speed`
    times: the critical tenant alone on the fleet (what the top band could reach with nobody below it), then all
    three without flow control, with it, and with it and preemption (gateway/flow/preempt.py). Their policies' engine
    priority follows the band (high, normal, low) in every run: what a deployment sets today, so the comparison is
    flow control against engine priorities alone."""
    span = trace[-1].timestamp_ms / 1000 / speed if trace else 0.0
    mixed = [r for r in split_bands(trace, speed) if window_s >= span or r.timestamp_ms <= window_s * 1000]
    window_s = min(window_s, span) if trace else window_s  # a window past the trace's end: the whole trace
    pol = {tenant_name(k + 1): FlowPolicy(band=b) for k, b in enumerate(BANDS)}
    sla = {t: routing.ttft_sla_ms / 1000 for t in pol}
    dem = {t: demand([r for r in mixed if tenant_name(r.tenant) == t], flow, window_s) for t in pol}
    flow = flow.model_copy(update={"bands": bands or flow.bands})
    on = flow.model_copy(update={"enabled": True})
    top = tenant_name(1)
    runs: list[tuple[str, list[TraceRecord], FlowControl | None, dict[str, float], bool]] = [
        ("critical alone", [r for r in mixed if tenant_name(r.tenant) == top], on, {top: dem[top]}, False),
        ("no flow control", mixed, None, dem, False),
        ("flow control", mixed, on, dem, False),
        ("flow control, preemption", mixed, on, dem, True)]
    out = []
    for label, recs, fc, d, preempt in runs:
        cb = progress(label, len(recs)) if progress else None
        out.append(run_mix(recs, targets, routing, fc, pol, sla, label, window_s, d, progress=cb,
                           priority={t: DEFAULT_PRIORITY_VALUES[c] for t, c in zip(pol, ("high", "normal", "low"))},
                           preempt=preempt))
    return out
