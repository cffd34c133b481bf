"""The fleet's capacity at SLA, for the priority scenario's overload (`gateway replay TRACE --bands --capacity`, or
`--overload X`: the three bands at X times that speed).

The capacity is a trace speed: the highest speed at which the fleet serves the scenario's whole workload — the whole
trace, split into three tenants as `--bands` splits it, every request in one engine class, without flow control —
with at least `target` (99%) of the requests *that can meet the SLA at all* within it. A request that cannot (its
TTFT alone on an idle replica holding its cached prefix is past the SLA: prompts of tens of thousands of tokens)
misses at any speed, so the share of *every* request cannot define a capacity; both shares are printed.

The whole trace, not the scenario's window: the trace's start is its conversations' cold first turns, so a short
window at a low speed measures the cold start, not the load.

The sweep goes up in steps of `step` until a speed misses the target, then halves the interval between the last
speed that met it and that first miss down to `resolution`; the capacity is the highest speed found meeting it
below the first miss. Every point replayed is printed (each one deterministic replay on the virtual clock). When
the first step already misses, `beyond` further steps are printed, so that a reader sees whether load is the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.config import Routing
from gateway.flow.settings import FlowControl, FlowPolicy
from gateway.recording.trace import TraceRecord
from gateway.routing.features import TargetInfo
from gateway_lab.replay.mix import demand, run_mix, split_bands, tenant_name
from gateway_lab.sim.profiles import ReplicaConfig

TARGET = 0.99


@dataclass
class Point:
    speed: float
    requests: int
    within_sla: float  # of every request
    within_sla_possible: float  # of those that can meet the SLA at all
    ttft_p95: float
    goodput: float

    def passes(self, target: float) -> bool:
        return self.within_sla_possible >= target

    def row(self, target: float) -> list[Any]:
        return [f"{self.speed:g}", self.requests, f"{self.within_sla * 100:.1f}%",
                f"{self.within_sla_possible * 100:.1f}%", f"{self.ttft_p95:.2f}", f"{self.goodput / 1000:.1f}k",
                "yes" if self.passes(target) else "no"]


HEADERS = ["speed", "requests", "within SLA", "of those possible", "TTFT p95", "goodput", "meets target"]


def workload(trace: Sequence[TraceRecord], speed: float) -> list[TraceRecord]:
    """The whole trace at `speed` as `--bands` splits it (split_bands: each tenant's own KV), as one tenant: one
    class, one flow."""
    return [replace(r, tenant=1) for r in split_bands(trace, speed)]


def point(trace: Sequence[TraceRecord], targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing,
          speed: float) -> Point:
    recs = workload(trace, speed)
    span = max(recs[-1].timestamp_ms / 1000, 1e-9)
    one = tenant_name(1)
    sla = routing.ttft_sla_ms / 1000
    res = run_mix(recs, targets, routing, None, {one: FlowPolicy()}, {one: sla}, f"speed {speed:g}", span,
                  {one: demand(recs, FlowControl(), span)})
    row = res.tenants[0]
    return Point(speed, row.requests, row.within_sla, row.within_sla_possible, row.ttft_p95, row.goodput)


def sweep(trace: Sequence[TraceRecord], targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing,
          step: float = 0.25, resolution: float = 0.05, target: float = TARGET, beyond: int = 2,
          progress: Callable[[Point], None] | None = None, limit: float = 20.0) -> tuple[float, list[Point]]:
    """(capacity speed, every point replayed, by speed). The capacity is 0 when the first step misses the target."""
    if step <= 0 or resolution <= 0:
        raise ValueError("the capacity step and resolution must be > 0")
    points: list[Point] = []

    def at(speed: float) -> Point:
        p = point(trace, targets, routing, round(speed, 6))
        points.append(p)
        if progress:
            progress(p)
        return p

    lo, hi, k = 0.0, 0.0, 1
    while k * step <= limit:
        if not at(k * step).passes(target):
            hi = k * step
            break
        lo, k = k * step, k + 1
    if not hi:
        return lo, points
    if not lo:
        for j in range(1, beyond + 1):
            at((k + j) * step)
        return 0.0, sorted(points, key=lambda p: p.speed)
    while hi - lo > resolution * 1.001:
        mid = round(round((lo + hi) / 2 / resolution) * resolution, 6)
        if mid <= lo or mid >= hi:
            break
        if at(mid).passes(target):
            lo = mid
        else:
            hi = mid
    return lo, sorted(points, key=lambda p: p.speed)
