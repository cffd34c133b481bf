"""Baseline policies, for comparison in benchmarks and as simple choices.

round_robin — prefers the next replica in turn. Inputs: none. Tie-break: order.
least_loaded — prefers the fewest in-flight requests, then the fewest queued prefill tokens. Tie-break: name.
Both rank the rest as fallbacks and never shed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gateway.routing.decision import Decision
from gateway.routing.features import Candidate
from gateway.routing.request import RoutingRequest


class RoundRobin:
    def __init__(self) -> None:
        self._n = itertools.count()

    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate], p: object = None) -> Decision:
        if not cands:
            return Decision((), "no_candidates", {})
        self_hosted = [c for c in cands if c.info.self_hosted] or list(cands)
        k = next(self._n) % len(self_hosted)
        ordered = self_hosted[k:] + self_hosted[:k] + [c for c in cands if c not in self_hosted]
        return Decision(tuple(c.info.ref if c.info.ref is not None else c.info for c in ordered), "round_robin", {},
                        {c.name: c for c in ordered})


def least_loaded(req: RoutingRequest, cands: Sequence[Candidate], p: object = None) -> Decision:
    if not cands:
        return Decision((), "no_candidates", {})
    self_hosted = [c for c in cands if c.info.self_hosted] or list(cands)
    ordered = sorted(self_hosted, key=lambda c: (c.load.inflight, c.load.queued_prefill_tokens, c.name))
    ordered += [c for c in cands if c not in self_hosted]
    return Decision(tuple(c.info.ref if c.info.ref is not None else c.info for c in ordered), "least_loaded", {},
                    {c.name: c for c in ordered})
