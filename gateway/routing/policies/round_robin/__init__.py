"""round_robin: a baseline policy (README.md)."""

from gateway.routing.policies.round_robin.policy import SPEC, Params

__all__ = ["SPEC", "Params"]
