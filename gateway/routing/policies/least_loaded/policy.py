"""least_loaded — the self-hosted replica with the fewest requests in flight (README.md beside this file)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, R
from gateway.routing.policy import PolicyContext, PolicyParams, PolicySpec
from gateway.routing.request import RoutingRequest


class Params(PolicyParams):
    type: Literal["least_loaded"] = "least_loaded"


class LeastLoaded:
    def __init__(self, p: Params | None = None, ctx: PolicyContext | None = None) -> None:
        pass

    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate[R]], /) -> Decision[R]:
        if not cands:
            return Decision((), "no_candidates", Inputs.of(req))
        self_hosted = [c for c in cands if c.self_hosted] or list(cands)
        ordered = sorted(self_hosted, key=lambda c: (c.load.inflight, c.load.queued_prefill_tokens, c.name))
        ordered += [c for c in cands if c not in self_hosted]
        return Decision.of(ordered, "least_loaded", Inputs.of(req))


SPEC = PolicySpec("least_loaded", Params, False, LeastLoaded,
                  "the self-hosted replica with the fewest requests in flight (a baseline)")
