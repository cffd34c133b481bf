"""What a pool weight or a tenant pin would have moved, re-deciding recent decisions (pure, no I/O).

Each recent decision kept its request and every candidate's features (load, predicted TTFT, cost) as they were when
it was made. A preview changes only what the change would change — the pool's weight divides routing cost, a pin
leaves only the pinned pool's candidates — and runs the same policy again; a decision "moves" when its chosen
replica differs. Loads are those of the moment of each decision, so the figure says where that traffic would have
gone, not what the fleet's load would have become.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from gateway.routing.decision import Decision
from gateway.routing.engine import RoutingEngine
from gateway.routing.features import Candidate, R
from gateway.routing.request import RoutingRequest

Past = tuple[RoutingRequest, Decision[Any]]


def reweighted(cands: Iterable[Candidate[R]], pool: str, weight: float) -> list[Candidate[R]]:
    """The candidates as they would be with `pool`'s weight set to `weight` (0: the pool takes no new traffic)."""
    out = []
    for c in cands:
        if c.info.pool != pool:
            out.append(c)
        elif weight > 0:
            old = max(c.info.weight, 1e-9)
            out.append(replace(c, info=replace(c.info, weight=weight), cost=c.cost * old / weight))
    return out


def pinned(cands: Iterable[Candidate[R]], pool: str) -> list[Candidate[R]]:
    return [c for c in cands if c.info.pool == pool]


def preview(engine: RoutingEngine, past: Iterable[Past], *, pool: str | None = None, weight: float | None = None,
            tenant: str | None = None, pin_pool: str | None = None) -> dict[str, Any]:
    """Either a weight change (`pool`, `weight`) or a pin (`tenant`, `pin_pool`: None clears a pin, which needs
    the unpinned candidates and is not previewable from decisions made under the pin)."""
    moved: Counter[tuple[str, str]] = Counter()
    considered = stayed = unservable = 0
    for req, d in past:
        if tenant is not None and req.tenant != tenant:
            continue
        cands = list(d.features.values())
        if d.chosen is None or not cands:
            continue
        considered += 1
        if pin_pool is not None:
            new_cands = pinned(cands, pin_pool)
        else:
            assert pool is not None and weight is not None
            new_cands = reweighted(cands, pool, weight)
        if not new_cands:
            unservable += 1  # no candidate would be left (the pool was not among this request's candidates)
            continue
        again = engine.policy(req, new_cands)
        if again.chosen is None:
            unservable += 1
        elif again.chosen.name == d.chosen.name:
            stayed += 1
        else:
            moved[(d.chosen.name, again.chosen.name)] += 1
    by_pool: Counter[tuple[str, str]] = Counter()
    owner = {c.name: c.info.pool for _, d in past for c in d.features.values()}
    for (a, b), n in moved.items():
        by_pool[(owner.get(a, "?"), owner.get(b, "?"))] += n
    return {
        "decisions": considered, "would_move": sum(moved.values()), "would_stay": stayed,
        "would_have_no_replica": unservable,
        "moves": [{"from": a, "to": b, "requests": n} for (a, b), n in moved.most_common()],
        "moves_by_pool": [{"from": a, "to": b, "requests": n} for (a, b), n in by_pool.most_common()],
    }
