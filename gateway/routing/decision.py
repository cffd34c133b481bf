"""A routing decision is a value: the ranked candidates (first = chosen), a branch label, its inputs, and the
features of every candidate (read back by the feedback hooks after dispatch and by the explain endpoint)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic

from gateway.routing.features import Candidate, R
from gateway.routing.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the decision was taken on, as the explain endpoint and the decision log show it."""

    sla_s: float
    objective: str
    prompt_tokens: int
    chunks: int  # prefix chunk hashes of the request (0: the policy uses no prefix data)
    retry_after_s: float | None = None  # a shed decision: when the least-loaded candidate is predicted to fit

    @classmethod
    def of(cls, req: RoutingRequest, retry_after_s: float | None = None) -> Inputs:
        return cls(req.ttft_sla_s, req.objective, req.prompt_tokens, len(req.hashes), retry_after_s)

    def explain(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sla_s": self.sla_s, "objective": self.objective, "prompt_tokens": self.prompt_tokens,
                               "chunks": self.chunks}
        if self.retry_after_s is not None:
            out["retry_after_s"] = self.retry_after_s
        return out


@dataclass(frozen=True)
class Decision(Generic[R]):
    ranked: tuple[Candidate[R], ...]  # chosen first, then fallbacks in order; () = shed or nothing to route to
    branch: str  # prefix_hit, cold_ring, sticky_break, warm_over_sla, sla_spill, sla_miss_least_ttft, shed, ...
    inputs: Inputs
    features: Mapping[str, Candidate[R]] = field(default_factory=dict)  # every candidate, by target name

    @classmethod
    def of(cls, ordered: tuple[Candidate[R], ...] | list[Candidate[R]], branch: str, inputs: Inputs) -> Decision[R]:
        """A decision ranking `ordered`, with their features."""
        return cls(tuple(ordered), branch, inputs, {c.name: c for c in ordered})

    @property
    def chosen(self) -> Candidate[R] | None:
        return self.ranked[0] if self.ranked else None

    def explain(self) -> dict[str, Any]:
        return {
            "branch": self.branch,
            "chosen": self.chosen.name if self.chosen is not None else None,
            "pool": self.chosen.pool if self.chosen is not None else None,
            "fallbacks": [c.name for c in self.ranked[1:]],
            "inputs": self.inputs.explain(),
            "candidates": [c.explain() for c in self.features.values()],
        }
