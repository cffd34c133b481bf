"""round_robin — the next self-hosted replica in turn (README.md beside this file)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, R
from gateway.routing.policy import PolicyContext, PolicyParams, PolicySpec
from gateway.routing.request import RoutingRequest


class Params(PolicyParams):
    type: Literal["round_robin"] = "round_robin"


class RoundRobin:
    def __init__(self, p: Params | None = None, ctx: PolicyContext | None = None) -> None:
        self._n = itertools.count()

    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate[R]], /) -> Decision[R]:
        if not cands:
            return Decision((), "no_candidates", Inputs.of(req))
        self_hosted = [c for c in cands if c.self_hosted] or list(cands)
        k = next(self._n) % len(self_hosted)
        ordered = self_hosted[k:] + self_hosted[:k] + [c for c in cands if c not in self_hosted]
        return Decision.of(ordered, "round_robin", Inputs.of(req))


SPEC = PolicySpec("round_robin", Params, False, RoundRobin, "the next self-hosted replica in turn (a baseline)")
