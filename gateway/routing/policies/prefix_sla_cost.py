"""prefix_sla_cost — the default policy.

Prefers: among candidates predicted to meet the request's TTFT SLA (with headroom), the cheapest for this request.
Cost already rewards cache hits (uncached prefill is what costs replica time) and prices a spill to a per-token
pool at its full prefill, so the warmest self-hosted replica wins while it keeps the SLA, other self-hosted
replicas come next, and the per-token pool takes the overflow.
- Stickiness is broken per request, never fleet-wide: when some feasible candidates are predicted faster than the
  choice by more than `stickiness_penalty`, the cheapest of them is taken instead.
- Cold prefixes (no meaningful hit among the cheapest) are placed by consistent hashing with bounded loads on the
  request's group key, so every gateway instance places them alike without talking.
- Nothing feasible: the least predicted TTFT (`sla_miss_least_ttft`), or shed (`shed`) when the tenant says so.
Inputs: Candidate features. Output: a Decision with ranked fallbacks and a branch label.
Tie-break: lower predicted TTFT, then name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def decide(req: RoutingRequest, cands: Sequence[Candidate], p: Params) -> Decision:
    # per-candidate features are rendered by Decision.explain() only when someone asks (off the hot path)
    inputs = {"sla_s": req.ttft_sla_s, "objective": req.objective, "prompt_tokens": req.prompt_tokens,
              "chunks": len(req.hashes)}
    if not cands:
        return Decision((), "no_candidates", inputs)
    limit = req.ttft_sla_s * (1 - p.sla_headroom)
    feasible = [c for c in cands if c.ttft <= limit]
    infeasible = sorted((c for c in cands if c.ttft > limit), key=lambda c: (c.ttft, c.name))
    if not feasible:
        if req.on_sla_miss == "shed":
            return Decision((), "shed", {**inputs, "retry_after_s": _retry_after(cands, limit)})
        return _decision(infeasible, "sla_miss_least_ttft", inputs)
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
    if not chosen.info.self_hosted and any(c.info.self_hosted for c in cands):
        branch = "sla_spill"
    rest = sorted((c for c in feasible if c is not chosen), key=lambda c: (c.cost, c.ttft, c.name))
    return _decision([chosen] + rest + infeasible, branch, inputs)


def _decision(ordered: Sequence[Candidate], branch: str, inputs: dict[str, object]) -> Decision:
    return Decision(tuple(c.info.ref if c.info.ref is not None else c.info for c in ordered), branch, inputs,
                    {c.name: c for c in ordered})


def _retry_after(cands: Sequence[Candidate], limit: float) -> float:
    """How long until the least-loaded candidate's predicted TTFT drops to the limit (>= 1 s)."""
    best = min(c.ttft for c in cands)
    return max(1.0, min(30.0, best - limit))
