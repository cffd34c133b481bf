"""When may a queued request go, and where: late binding against a bound on the queue ahead of it.

Under contention a request is routed with a tightened SLA, its *bound*: its own prefill on an idle replica holding
none of it (`own_cold`), plus `engine_queue` x its SLA. The routing engine picks the cheapest target predicted within
the bound — any target with at most that much queued ahead qualifies, and a warm one with a deeper queue does when
its cached prefix saves more than the extra wait. The request goes when its chosen target is predicted within the
refined bound: its own prefill where that is least (its warmest replica) plus the allowance (`verdict`; when
another target meets it, the engine decides again against it). Otherwise the fleet is full for it, and it waits in the gateway's queue where the fair order, not
arrival, decides who goes next.

Why a bound on the queue, not the whole SLA: if requests were admitted while predicted within their SLA, every engine
would hold an SLA's worth of queue, and a request the fair order puts first (a tenant under its share, a higher
band) would wait for that queue to drain and arrive late. With the engines' queues short (busy, not deep) that
request is placed at the next first token. The bound does not shrink while a request waits: a late request is placed
as any other (the controller orders it after its tenant's requests that can still make their deadline).
A decision without a chosen target (shed, nothing healthy) never admits; one without predictions (policies that
do not predict) always does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.config import PoolTiming
from gateway.flow.controller import FlowController, Ticket
from gateway.prediction.ttft import LoadView, predict_ttft
from gateway.routing.decision import Decision
from gateway.routing.features import Candidate
from gateway.routing.request import RoutingRequest


def bound(req: RoutingRequest, timing: PoolTiming, engine_queue: float) -> float:
    """The TTFT a request under contention is routed and dispatched against (seconds)."""
    return predict_ttft(timing, LoadView(), req.prompt_tokens) + engine_queue * req.ttft_sla_s


def tightened(req: RoutingRequest, bound_s: float) -> RoutingRequest:
    return replace(req, ttft_sla_s=bound_s)


def admits(decision: Decision[Any], bound_s: float) -> bool:
    chosen = decision.chosen
    if chosen is None:
        return False
    cand: Candidate[Any] | None = decision.features.get(chosen.name)
    return cand is None or cand.ttft_raw <= 0 or cand.ttft <= bound_s


def _own(c: Candidate[Any]) -> float:
    """The request's own prefill on this candidate were it idle (with what it holds cached), corrected alike."""
    scale = c.ttft / c.ttft_raw if c.ttft_raw > 0 else 1.0
    return predict_ttft(c.info.timing, LoadView(), c.uncached_tokens) * scale


def verdict(decision: Decision[Any], req: RoutingRequest, engine_queue: float) -> tuple[bool, float | None]:
    """Read a decision made against `bound` (the cold prefill + the queue allowance): the allowance applies to the
    request's own prefill where it is cheapest (its warmest replica), or a request with most of its prompt cached
    would be let onto a replica with a cold prompt's worth of queue. Returns (admit, None), or (False, b) when a
    candidate meets the refined bound `b` that the decision did not choose: decide again against `b`."""
    feats: list[Candidate[Any]] = list(decision.features.values())
    if decision.chosen is None or not feats or any(c.ttft_raw <= 0 for c in feats):
        return admits(decision, bound(req, _timing(decision), engine_queue) if feats else 0.0), None
    b = min(_own(c) for c in feats) + engine_queue * req.ttft_sla_s
    if admits(decision, b):
        return True, None
    return False, (b if any(c.ttft <= b for c in feats) else None)


def _timing(decision: Decision[Any]) -> PoolTiming:
    c: Candidate[Any] = next(iter(decision.features.values()))
    return c.info.timing


def meets_sla(decision: Decision[Any], req: RoutingRequest, engine_queue: float) -> bool:
    """Nothing is waiting: a request goes at once when its decision, made as routing makes it, is predicted within
    its whole SLA — or, for a prompt too long to make it even alone, within its own prefill plus the allowance. The
    tighter bound only keeps room for requests the fair order puts first; with none waiting, holding one back costs
    it (and the fleet) for nobody's benefit."""
    feats: list[Candidate[Any]] = list(decision.features.values())
    if not feats or any(c.ttft_raw <= 0 for c in feats):
        return admits(decision, req.ttft_sla_s)
    return admits(decision, max(req.ttft_sla_s, min(_own(c) for c in feats) + engine_queue * req.ttft_sla_s))


def placed_cost(ctl: FlowController, t: Ticket, decision: Decision[Any]) -> float | None:
    """What `t` costs where the decision places it: its uncached prompt at the prefill weight, the chosen replica's
    cached prefix at the cached weight. None when the decision has no prediction (the estimate stands)."""
    chosen = decision.chosen
    cand: Candidate[Any] | None = decision.features.get(chosen.name) if chosen is not None else None
    if cand is None:
        return None
    return ctl.cost(cand.uncached_tokens, cand.cached_tokens, t.output_tokens)
