"""When may a queued request go, and where: late binding against a bound on the queue ahead of it.

Under contention a request is routed with a tightened SLA, its *bound*: its own prefill on an idle replica holding
none of it (`own_cold`), plus `engine_queue` x its SLA. The routing engine picks the cheapest target predicted within
the bound — any target with at most that much queued ahead qualifies, and a warm one with a deeper queue does when
its cached prefix saves more than the extra wait. The request goes when a target of the decision's ranking is
predicted within the refined bound: its own prefill where that is least (its warmest replica) plus the allowance
(`verdict`). Otherwise the fleet is full for it, and it waits in the gateway's queue where the fair order, not
arrival, decides who goes next.

Why a bound on the queue, not the whole SLA: if requests were admitted while predicted within their SLA, every engine
would hold an SLA's worth of queue, and a request the fair order puts first (a tenant under its share, a higher
band) would wait for that queue to drain and arrive late. With the engines' queues short (busy, not deep) that
request is placed at the next first token. The bound does not shrink while a request waits: a late request is placed
as any other (the controller orders it after its tenant's requests that can still make their deadline).
A flow under its share (`FlowController.under_share`) and a request with nothing waiting go against their whole
SLA (`meets_sla`): the bound only keeps room for the requests the fair order puts first, and these are first.
A decision whose chosen target is past the bound goes on the policy's next choice within it (`within`).
A decision without a chosen target (shed, nothing healthy) never admits; one without predictions (policies that
do not predict) always does.
"""

from __future__ import annotations

from collections.abc import Callable
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


def within(decision: Decision[Any], bound_s: float) -> Decision[Any] | None:
    """The decision to dispatch on under `bound_s`: the decision itself when its chosen target is predicted within
    the bound (or predicts nothing); else the policy's next choice in its own ranking that is, moved first (branch
    `flow_bound`); None when no target is (shed, nothing healthy, or all past the bound). Why not wait for the
    policy's first choice: it may prefer a warm replica past the bound (`warm_over_sla`, `sla_miss_*`), where it
    trades the request's wait for the fleet's recompute; a held request waiting for it blocks the queue behind it,
    and the gateway's queue is where it waits instead."""
    for i, c in enumerate(decision.ranked):
        if c.ttft_raw <= 0 or c.ttft <= bound_s:
            if i == 0:
                return decision
            return replace(decision, ranked=(c, *decision.ranked[:i], *decision.ranked[i + 1:]), branch="flow_bound")
    return None


def admits(decision: Decision[Any], bound_s: float) -> bool:
    return within(decision, bound_s) is not None


def _own(c: Candidate[Any]) -> float:
    """The request's own prefill on this candidate were it idle (with what it holds cached), corrected alike."""
    scale = c.ttft / c.ttft_raw if c.ttft_raw > 0 else 1.0
    return predict_ttft(c.info.timing, LoadView(), c.uncached_tokens) * scale


def verdict(decision: Decision[Any], req: RoutingRequest, engine_queue: float) -> Decision[Any] | None:
    """Read a decision made against `bound` (the cold prefill + the queue allowance): the allowance applies to the
    request's own prefill where it is cheapest (its warmest replica), or a request with most of its prompt cached
    would be let onto a replica with a cold prompt's worth of queue. Returns the decision to dispatch on (`within`
    the refined bound), or None: the fleet has no room for it now."""
    feats: list[Candidate[Any]] = list(decision.features.values())
    if decision.chosen is None or not feats or any(c.ttft_raw <= 0 for c in feats):
        return within(decision, bound(req, _timing(decision), engine_queue) if feats else 0.0)
    return within(decision, min(_own(c) for c in feats) + engine_queue * req.ttft_sla_s)


def _timing(decision: Decision[Any]) -> PoolTiming:
    c: Candidate[Any] = next(iter(decision.features.values()))
    return c.info.timing


def meets_sla(decision: Decision[Any], req: RoutingRequest, engine_queue: float) -> Decision[Any] | None:
    """A request goes at once when its decision, made as routing makes it, is predicted within its whole SLA — or,
    for a prompt too long to make it even alone, within its own prefill plus the allowance (`within`: the decision
    to dispatch on, or None). With nothing waiting, or for a flow under its share (`FlowController.under_share`):
    the tighter bound only keeps room for requests the fair order puts first, and this one is first."""
    feats: list[Candidate[Any]] = list(decision.features.values())
    if not feats or any(c.ttft_raw <= 0 for c in feats):
        return within(decision, req.ttft_sla_s)
    return within(decision, max(req.ttft_sla_s, min(_own(c) for c in feats) + engine_queue * req.ttft_sla_s))


def placed_cost(ctl: FlowController, t: Ticket, decision: Decision[Any]) -> float | None:
    """What `t` costs where the decision places it: its uncached prompt at the prefill weight, the chosen replica's
    cached prefix at the cached weight. None when the decision has no prediction (the estimate stands)."""
    chosen = decision.chosen
    cand: Candidate[Any] | None = decision.features.get(chosen.name) if chosen is not None else None
    if cand is None:
        return None
    return ctl.cost(cand.uncached_tokens, cand.cached_tokens, t.output_tokens)


def budget_s(req: RoutingRequest, timing: PoolTiming, waited: float) -> float:
    """Seconds of queue the request can still find ahead of it and meet its SLA: what is left of the SLA after
    `waited` less its own prefill on an idle replica holding none of it (what preemption may make room for)."""
    return req.ttft_sla_s - waited - predict_ttft(timing, LoadView(), req.prompt_tokens)


def late(decision: Decision[Any], req: RoutingRequest, waited: float) -> bool:
    """The decision's chosen target is predicted past what is left of the request's SLA (no prediction: not late)."""
    chosen = decision.chosen
    cand: Candidate[Any] | None = decision.features.get(chosen.name) if chosen is not None else None
    return cand is not None and cand.ttft_raw > 0 and cand.ttft > req.ttft_sla_s - waited


class Pass:
    """One pass over the queue (`lookahead`): the requests the fleet had no room for, passed over so that those
    behind them in the fair order are not held too, and the targets they wait for (their decision's first choice,
    typically the replica holding their prefix). A request behind them goes only on another target: passing over a
    request must not hand the replica it waits for to the requests it was ahead of. `elsewhere(target, t)`: whether
    another gateway instance has a request ahead of `t` waiting for `target` (`waits.WaitBoard`), which holds `t` off
    that target alike."""

    def __init__(self, lookahead: int, elsewhere: Callable[[str, Ticket], bool] | None = None) -> None:
        self.lookahead = lookahead
        self.elsewhere = elsewhere
        self.skip: set[Ticket] = set()
        self.waits: dict[str, tuple[int, float]] = {}  # target waited for -> its most urgent waiter's (band, start tag)

    def free(self, go: Decision[Any] | None, t: Ticket) -> Decision[Any] | None:
        """`go`, unless it takes a target a request passed over in this pass, or one ahead of `t` on another
        instance, waits for."""
        if go is None or go.chosen is None:
            return go
        name = go.chosen.name
        if name in self.waits or (self.elsewhere is not None and self.elsewhere(name, t)):
            return None
        return go

    def passed(self, t: Ticket, decision: Decision[Any], start: float = 0.0) -> bool:
        """Pass over `t` (its flow's start tag `start`); False when the pass has looked far enough."""
        self.skip.add(t)
        if decision.chosen is not None:
            name = decision.chosen.name
            if name not in self.waits or (t.band, start) < self.waits[name]:
                self.waits[name] = (t.band, start)
        return len(self.skip) < self.lookahead
