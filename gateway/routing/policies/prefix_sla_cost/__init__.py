"""prefix_sla_cost: the default policy (README.md)."""

from gateway.routing.policies.prefix_sla_cost.policy import SPEC, Params, PrefixSlaCost

__all__ = ["SPEC", "Params", "PrefixSlaCost"]
