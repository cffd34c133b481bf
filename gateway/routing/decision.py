"""A routing decision is a value: the ranked targets (first = chosen), a branch label, its inputs, and the
features of each ranked target (read back by the feedback hooks after dispatch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    ranked: tuple[Any, ...]  # targets: chosen first, then fallbacks in order
    branch: str  # prefix_hit, cold_ring, sticky_break, warm_over_sla, sla_spill, sla_miss_least_ttft, sla_miss_warm, shed, ...
    inputs: dict[str, Any] = field(default_factory=dict)
    features: dict[str, Any] = field(default_factory=dict)  # target name -> Candidate

    @property
    def chosen(self) -> Any:
        return self.ranked[0] if self.ranked else None

    def explain(self) -> dict[str, Any]:
        return {
            "branch": self.branch,
            "chosen": self.chosen.name if self.chosen is not None else None,
            "pool": self.chosen.pool if self.chosen is not None else None,
            "fallbacks": [t.name for t in self.ranked[1:]],
            "inputs": self.inputs,
            "candidates": [c.explain() for c in self.features.values()],
        }
