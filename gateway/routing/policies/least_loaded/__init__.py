"""least_loaded: a baseline policy (README.md)."""

from gateway.routing.policies.least_loaded.policy import SPEC, Params

__all__ = ["SPEC", "Params"]
