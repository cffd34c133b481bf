"""prefix_sla_cost — the default policy.

Prefers: among candidates predicted to meet the request's TTFT SLA (with headroom), the cheapest for this request.
Cost already rewards cache hits (uncached prefill is what costs replica time) and prices a spill to a per-token
pool at its full prefill, so the warmest self-hosted replica wins while it keeps the SLA, other self-hosted
replicas come next, and the per-token pool takes the overflow.
- Stickiness is broken per request, never fleet-wide: when some feasible candidates are predicted faster than the
  choice by more than `stickiness_penalty`, the cheapest of them is taken instead.
- Cold prefixes (no meaningful hit among the cheapest) are placed by consistent hashing with bounded loads on the
  request's group key, so every gateway instance places them alike without talking.
- Recomputed prefill delays everyone queued behind it, so where the SLA cannot decide (nothing feasible, or the
  warmest replica is predicted past it) candidates are compared on their *fleet delay*: predicted TTFT plus
  `recompute_weight` x the prefill seconds they would recompute beyond the warmest self-hosted replica. A warm
  replica past the SLA behind a few long prefills (few requests in flight) then beats a feasible cold one that would
  recompute a long context (`warm_over_sla`). Only where no per-token pool is a candidate: with one, the SLA is kept by spilling (and cost
  already prices recompute among feasible candidates), so spill is unchanged. A tenant that sheds on SLA misses never
  gets a replica predicted past it. `recompute_weight` 0 is the plain rule.
- Nothing feasible: the least fleet delay (`sla_miss_least_ttft` when that is also the least TTFT, `sla_miss_warm`
  when the recompute term moved it to a warmer replica), or shed (`shed`) when the tenant says so.
Inputs: Candidate features. Output: a Decision with ranked fallbacks and a branch label.
Tie-break: lower predicted TTFT, then name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.prediction.ttft import DRAIN_BELOW
from gateway.routing.decision import Decision
from gateway.routing.features import Candidate
from gateway.routing.request import RoutingRequest
from gateway.routing.ring import place


@dataclass(frozen=True)
class Params:
    sla_headroom: float = 0.1
    stickiness_penalty_s: float = 1.0
    bounded_load_factor: float = 1.25
    min_hit_tokens: int = 256
    cost_tie: float = 0.02  # costs within 2% count as equal
    recompute_weight: float = 14.0  # others' waiting per second of recomputed prefill (docs/routing.md: the sweep)


def decide(req: RoutingRequest, cands: Sequence[Candidate], p: Params) -> Decision:
    # per-candidate features are rendered by Decision.explain() only when someone asks (off the hot path)
    inputs = {"sla_s": req.ttft_sla_s, "objective": req.objective, "prompt_tokens": req.prompt_tokens,
              "chunks": len(req.hashes)}
    if not cands:
        return Decision((), "no_candidates", inputs)
    limit = req.ttft_sla_s * (1 - p.sla_headroom)
    feasible = [c for c in cands if c.ttft <= limit]
    infeasible = sorted((c for c in cands if c.ttft > limit), key=lambda c: (c.ttft, c.name))
    delay = _fleet_delay(cands, p.recompute_weight)  # None: the SLA alone decides
    if not feasible:
        if req.on_sla_miss == "shed":
            return Decision((), "shed", {**inputs, "retry_after_s": _retry_after(cands, limit)})
        if delay is None:
            return _decision(infeasible, "sla_miss_least_ttft", inputs)
        first = min(infeasible, key=lambda c: (delay(c), c.ttft, c.name))
        branch = "sla_miss_least_ttft" if first is infeasible[0] else "sla_miss_warm"
        return _decision([first] + [c for c in infeasible if c is not first], branch, inputs)
    by_speed = sorted(feasible, key=lambda c: (c.ttft, c.name))
    if req.objective == "latency":
        return _decision(by_speed + infeasible, "latency", inputs)
    cheapest = min(c.cost for c in feasible)
    near = [c for c in feasible if c.cost <= cheapest * (1 + p.cost_tie) + 1e-12]
    best_cached = max(c.cached_tokens for c in near)
    if best_cached >= p.min_hit_tokens:
        chosen = min((c for c in near if c.cached_tokens == best_cached), key=lambda c: (c.ttft, c.name))
        branch = "prefix_hit"
    else:
        loads = {c.name: c.load.inflight for c in near}
        order = place(req.group_key, [c.name for c in near], loads, p.bounded_load_factor)
        chosen = next(c for c in near if c.name == order[0])
        branch = "cold_ring"
    faster = [c for c in feasible if c.ttft < chosen.ttft - p.stickiness_penalty_s]
    if faster:  # the cheapest of those that beat the choice by more than the penalty
        chosen = min(faster, key=lambda c: (c.cost, c.ttft, c.name))
        branch = "sticky_break" if branch == "prefix_hit" else "cold_fastest"
    if delay is not None and infeasible and req.on_sla_miss != "shed":
        warm = min(infeasible, key=lambda c: (delay(c), c.ttft, c.name))
        # only a replica busy with a few long prefills: one loaded with many requests is better left (moving a
        # prefix off it spreads the load; on the Wafer workload holding those cost 5 points within SLA)
        few = warm.load.inflight <= warm.info.timing.max_running * DRAIN_BELOW
        if few and warm.cached_tokens > chosen.cached_tokens and delay(warm) < delay(chosen):
            rest = sorted(feasible, key=lambda c: (c.cost, c.ttft, c.name))
            return _decision([warm] + rest + [c for c in infeasible if c is not warm], "warm_over_sla", inputs)
    if not chosen.info.self_hosted and any(c.info.self_hosted for c in cands):
        branch = "sla_spill"
    rest = sorted((c for c in feasible if c is not chosen), key=lambda c: (c.cost, c.ttft, c.name))
    return _decision([chosen] + rest + infeasible, branch, inputs)


def _fleet_delay(cands: Sequence[Candidate], weight: float) -> Callable[[Candidate], float] | None:
    """Predicted TTFT plus `weight` x the prefill seconds a self-hosted candidate recomputes beyond the warmest
    self-hosted one: that work delays every request queued behind it (on the conversation trace the warm replica a
    request left was a few seconds slower, and recomputing its context cost more than that to those after it)."""
    if not weight or not all(c.info.self_hosted for c in cands):
        # with a per-token pool to spill to, the SLA is kept by spilling and the cost already prices recompute
        return None
    floor = min((c.uncached_tokens for c in cands if c.info.self_hosted), default=0)

    def delay(c: Candidate) -> float:
        if not c.info.self_hosted:
            return c.ttft
        return c.ttft + weight * (c.uncached_tokens - floor) / c.info.timing.prefill_tokens_per_s

    return delay


def _decision(ordered: Sequence[Candidate], branch: str, inputs: dict[str, object]) -> Decision:
    return Decision(tuple(c.info.ref if c.info.ref is not None else c.info for c in ordered), branch, inputs,
                    {c.name: c for c in ordered})


def _retry_after(cands: Sequence[Candidate], limit: float) -> float:
    """How long until the least-loaded candidate's predicted TTFT drops to the limit (>= 1 s)."""
    best = min(c.ttft for c in cands)
    return max(1.0, min(30.0, best - limit))
