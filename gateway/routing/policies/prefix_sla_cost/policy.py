"""prefix_sla_cost — the default policy (README.md beside this file: what it prefers, inputs, output, parameters,
tie-break). `decide` is the rules below in order; each takes the candidates split at the SLA and returns a decision,
or a choice for the next rule to revise:

1. `no_candidates` — nothing to route to.
2. `nothing_feasible` — no candidate within the SLA: shed, or the least fleet delay (`sla_miss_*`).
3. `fastest` — objective latency: by predicted TTFT.
4. `cheapest` — among the feasible, the cheapest (cost ties within `cost_tie`); the warmest of those (`prefix_hit`),
   or, with no meaningful hit, consistent hashing with bounded loads on the request's group key (`cold_ring`).
5. `load_bound` — a self-hosted choice holding past `load_bound_factor` x the feasible self-hosted replicas' mean of
   requests in flight gives the request to the cheapest of those under it (`load_bound`); never at light load, nor
   while the choice holds at most `load_bound_floor` of its running slots.
6. `break_stickiness` — a feasible candidate faster by more than the stickiness penalty wins instead; a slow replica
   (its own TTFT correction past `slow_replica_factor`) keeps no stickiness.
7. `warm_over_sla` — with nothing to spill to, a warm replica past the SLA but behind few requests beats a cold
   feasible one when the recompute it saves outweighs the wait.
8. `label_spill` — the choice left the self-hosted replicas for a per-token pool (`sla_spill`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Literal

from pydantic import Field, field_validator

from gateway.prediction.ttft import DRAIN_BELOW
from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, R
from gateway.routing.policy import PolicyContext, PolicyParams, PolicySpec
from gateway.routing.request import RoutingRequest
from gateway.routing.ring import place


class Params(PolicyParams):
    type: Literal["prefix_sla_cost"] = "prefix_sla_cost"
    sla_headroom: float = Field(default=0.1, ge=0, lt=1, description="feasible: predicted TTFT <= SLA x (1 - this)")
    stickiness_penalty_ms: float = Field(default=1000, ge=0, description="leave a warm replica only if another "
                                         "feasible one is faster by more")
    recompute_weight: float = Field(default=14, ge=0, le=1000, description="seconds of other requests' waiting one "
                                    "second of recomputed prefill counts as, where the SLA cannot decide "
                                    "(0: least TTFT; docs/routing.md)")
    bounded_load_factor: float = Field(default=1.25, ge=1.0, description="cold placement: max load vs the mean")
    cost_tie: float = Field(default=0.02, ge=0, le=1, description="costs within this fraction count as equal")
    slow_replica_factor: float = Field(default=2.0, ge=0, le=100, description="a replica whose own TTFT correction "
                                       "is at least this (it runs this many times slower than its pool's model "
                                       "says and its peers do: a gray failure) keeps no stickiness: any feasible "
                                       "replica under it predicted faster takes the request (0: off; else > 1)")
    load_bound_factor: float = Field(default=2.0, ge=0, le=100, description="a self-hosted replica that would hold "
                                     "more than this x the feasible self-hosted replicas' mean of requests in flight "
                                     "gives the request to the cheapest under it, warm or not; never while they hold "
                                     "fewer in flight than there are of them, nor below 2 (0: off; else >= 1)")
    load_bound_floor: float = Field(default=0.25, ge=0, le=1, description="the load bound never binds while the "
                                    "choice would hold at most this share of its max_running requests in flight "
                                    "(on a replica running as its pool's model says): a batch that small decodes "
                                    "almost as fast as an empty one, and a move recomputes the request's context")

    @field_validator("slow_replica_factor")
    @classmethod
    def _slow_is_slower(cls, v: float) -> float:
        if 0 < v <= 1:
            raise ValueError("slow_replica_factor is 0 (off) or > 1: at 1 or under every replica would be slow")
        return v

    @field_validator("load_bound_factor")
    @classmethod
    def _bound_is_at_least_the_mean(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("load_bound_factor is 0 (off) or >= 1: under 1 every replica would be past the mean")
        return v


@dataclass(frozen=True)
class Split(Generic[R]):
    """One request's candidates split at its SLA limit, and how the SLA-blind comparisons weigh them."""

    cands: Sequence[Candidate[R]]
    feasible: list[Candidate[R]]
    infeasible: list[Candidate[R]]  # by (predicted TTFT, name)
    limit: float
    delay: Callable[[Candidate[R]], float] | None  # None: the SLA alone decides (see fleet_delay)

    @classmethod
    def of(cls, req: RoutingRequest, cands: Sequence[Candidate[R]], p: Params) -> Split[R]:
        limit = req.ttft_sla_s * (1 - p.sla_headroom)
        return cls(cands, [c for c in cands if c.ttft <= limit],
                   sorted((c for c in cands if c.ttft > limit), key=lambda c: (c.ttft, c.name)), limit,
                   fleet_delay(cands, p.recompute_weight))


class PrefixSlaCost:
    def __init__(self, p: Params, ctx: PolicyContext) -> None:
        self.p = p
        self.min_hit_tokens = ctx.chunk_tokens  # a hit under one chunk is no reason to prefer a replica
        self.stickiness_s = p.stickiness_penalty_ms / 1000

    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate[R]], /) -> Decision[R]:
        # per-candidate features are rendered by Decision.explain() only when someone asks (off the hot path)
        inputs = Inputs.of(req)
        if not cands:
            return Decision((), "no_candidates", inputs)
        s = Split.of(req, cands, self.p)
        if not s.feasible:
            return nothing_feasible(req, s, inputs)
        if req.objective == "latency":
            return fastest(s, inputs)
        chosen, branch = cheapest(req, s, self.p, self.min_hit_tokens)
        chosen, branch = load_bound(req, s, chosen, branch, self.p, self.min_hit_tokens)
        chosen, branch = break_stickiness(s, chosen, branch, self.stickiness_s, self.p.slow_replica_factor)
        warm = warm_over_sla(req, s, chosen, inputs)
        if warm is not None:
            return warm
        rest = sorted((c for c in s.feasible if c is not chosen), key=lambda c: (c.cost, c.ttft, c.name))
        return Decision.of([chosen] + rest + s.infeasible, label_spill(s, chosen, branch), inputs)


def nothing_feasible(req: RoutingRequest, s: Split[R], inputs: Inputs) -> Decision[R]:
    """Shed when the tenant says so; otherwise the least fleet delay (the least TTFT when the SLA alone decides)."""
    if req.on_sla_miss == "shed":
        return Decision((), "shed", Inputs.of(req, retry_after_s=retry_after(s.cands, s.limit)))
    delay = s.delay
    if delay is None:
        return Decision.of(s.infeasible, "sla_miss_least_ttft", inputs)
    first = min(s.infeasible, key=lambda c: (delay(c), c.ttft, c.name))
    branch = "sla_miss_least_ttft" if first is s.infeasible[0] else "sla_miss_warm"
    return Decision.of([first] + [c for c in s.infeasible if c is not first], branch, inputs)


def fastest(s: Split[R], inputs: Inputs) -> Decision[R]:
    return Decision.of(sorted(s.feasible, key=lambda c: (c.ttft, c.name)) + s.infeasible, "latency", inputs)


def cheapest(req: RoutingRequest, s: Split[R], p: Params, min_hit_tokens: int) -> tuple[Candidate[R], str]:
    """The warmest of the cheapest feasible candidates, or the ring's choice among them when none holds a hit."""
    low = min(c.cost for c in s.feasible)
    near = [c for c in s.feasible if c.cost <= low * (1 + p.cost_tie) + 1e-12]
    best_cached = max(c.cached_tokens for c in near)
    if best_cached >= min_hit_tokens:
        return min((c for c in near if c.cached_tokens == best_cached), key=lambda c: (c.ttft, c.name)), "prefix_hit"
    loads = {c.name: c.load.inflight for c in near}
    order = place(req.group_key, [c.name for c in near], loads, p.bounded_load_factor)
    return next(c for c in near if c.name == order[0]), "cold_ring"


MIN_BOUND = 2.0  # a replica that would hold this many requests in flight or fewer is never past the bound
FLOOR_SLOWNESS = 1.25  # load_bound_floor holds only for a replica whose own TTFT correction is at most this


def load_bound(req: RoutingRequest, s: Split[R], chosen: Candidate[R], branch: str, p: Params,
               min_hit_tokens: int) -> tuple[Candidate[R], str]:
    """Bounded loads (as the cold ring's) for the warm choice too, on the requests in flight at each replica (every
    instance's, from the load tracker, with the decisions not yet dispatched): prefix affinity alone keeps each group
    where it first landed, so the groups of a replica taken out of routing pile on whichever peer the hash names.
    The choice is past the bound when, with this request, it would hold more than max(MIN_BOUND, `load_bound_factor`
    x the feasible self-hosted replicas' mean, this request counted); the request then goes to the cheapest of those
    under it (a warm one first, else the ring among them), and the group is warm on both. Light load is left to
    affinity: while those replicas hold fewer requests in flight than there are of them, nothing is past the bound,
    so a conversation's turns stay where its context is. Past it a replica holds more than twice the mean (factor 2)
    and at least MIN_BOUND requests: with three replicas two thirds of all in flight, with four half; in a fleet of
    two replicas it never binds (neither can hold more than twice the mean). Nor while the choice would hold at most
    `load_bound_floor` of its running slots (a quarter: 12 of 48): a batch that small decodes almost as fast as an
    empty one, while the move recomputes the request's context elsewhere (on the conversation trace at 8 nodes the
    bound moved a quarter of the requests, off replicas holding ~7 in flight, and kept 2 points of hit rate from it).
    The floor holds only on a replica running as its pool's model says (its own correction at most FLOOR_SLOWNESS):
    on a slowed one requests pile up because it is slow, and the bound is what moves them first (a replica slowed 6x
    served 7 requests of its fault window with the bound at its old reach, 14 with the floor on it)."""
    if not p.load_bound_factor or not chosen.self_hosted:
        return chosen, branch
    hosted = [c for c in s.feasible if c.self_hosted]
    total = sum(c.load.inflight for c in hosted)
    if total < len(hosted):
        return chosen, branch
    # the floor trusts the pool's timing model: a replica running slower than it says gets the bound without it
    floor = p.load_bound_floor * chosen.info.timing.max_running if chosen.slowness <= FLOOR_SLOWNESS else 0.0
    bound = max(MIN_BOUND, floor, p.load_bound_factor * (total + 1) / len(hosted))
    under = [c for c in hosted if c.load.inflight + 1 <= bound]
    if chosen.load.inflight + 1 <= bound or not under:
        return chosen, branch
    return cheapest(req, replace(s, feasible=under), p, min_hit_tokens)[0], "load_bound"


def break_stickiness(s: Split[R], chosen: Candidate[R], branch: str, penalty_s: float,
                     slow: float = 0.0) -> tuple[Candidate[R], str]:
    """Per request, never fleet-wide: the cheapest of the feasible candidates faster than the choice by more than
    the penalty. A choice that is a slow replica (its own correction at least `slow`) keeps no stickiness: the
    cheapest of the feasible replicas that are not slow and are predicted faster (`slow_replica`). Why: its cache
    saves recompute once, its slowness costs every request sent there; with short prompts a 6x slower warm replica
    stays under the penalty (0.9 s against 0.3 s cold) and keeps its share at a p95 three times the fleet's."""
    if slow and chosen.slowness >= slow:
        well = [c for c in s.feasible if c.slowness < slow and c.ttft < chosen.ttft]
        if well:
            return min(well, key=lambda c: (c.cost, c.ttft, c.name)), "slow_replica"
    faster = [c for c in s.feasible if c.ttft < chosen.ttft - penalty_s]
    if not faster:
        return chosen, branch
    return (min(faster, key=lambda c: (c.cost, c.ttft, c.name)),
            "sticky_break" if branch == "prefix_hit" else "cold_fastest")


def warm_over_sla(req: RoutingRequest, s: Split[R], chosen: Candidate[R], inputs: Inputs) -> Decision[R] | None:
    """A warmer replica past the SLA whose fleet delay is below the choice's, when it is busy with a few long
    prefills (only where the SLA cannot decide: no per-token pool; never for a tenant that sheds)."""
    delay = s.delay
    if delay is None or not s.infeasible or req.on_sla_miss == "shed":
        return None
    warm = min(s.infeasible, key=lambda c: (delay(c), c.ttft, c.name))
    # only a replica busy with a few long prefills: one loaded with many requests is better left (moving a
    # prefix off it spreads the load; on the Wafer workload holding those cost 5 points within SLA)
    few = warm.load.inflight <= warm.info.timing.max_running * DRAIN_BELOW
    if not (few and warm.cached_tokens > chosen.cached_tokens and delay(warm) < delay(chosen)):
        return None
    rest = sorted(s.feasible, key=lambda c: (c.cost, c.ttft, c.name))
    return Decision.of([warm] + rest + [c for c in s.infeasible if c is not warm], "warm_over_sla", inputs)


def label_spill(s: Split[R], chosen: Candidate[R], branch: str) -> str:
    return "sla_spill" if not chosen.self_hosted and any(c.self_hosted for c in s.cands) else branch


def fleet_delay(cands: Sequence[Candidate[R]], weight: float) -> Callable[[Candidate[R]], float] | None:
    """Predicted TTFT plus `weight` x the prefill seconds a self-hosted candidate recomputes beyond the warmest
    self-hosted one: that work delays every request queued behind it (on the conversation trace the warm replica a
    request left was a few seconds slower, and recomputing its context cost more than that to those after it)."""
    if not weight or not all(c.self_hosted for c in cands):
        # with a per-token pool to spill to, the SLA is kept by spilling and the cost already prices recompute
        return None
    floor = min((c.uncached_tokens for c in cands if c.self_hosted), default=0)

    def delay(c: Candidate[R]) -> float:
        if not c.self_hosted:
            return c.ttft
        return c.ttft + weight * (c.uncached_tokens - floor) / c.info.timing.prefill_tokens_per_s

    return delay


def retry_after(cands: Sequence[Candidate[R]], limit: float) -> float:
    """How long until the least-loaded candidate's predicted TTFT drops to the limit (>= 1 s)."""
    best = min(c.ttft for c in cands)
    return max(1.0, min(30.0, best - limit))


SPEC = PolicySpec("prefix_sla_cost", Params, True, PrefixSlaCost,
                  "the cheapest candidate predicted to meet the TTFT SLA, warm replicas first")
