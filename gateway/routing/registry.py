"""The one place policy names live: the registered policies, the routing config's `policy:` union built from their
params models, and the one place the routing engine is built from config (the gateway and `gateway replay` both call
`build_engine`).

A new policy is a module in `routing/policies/` exporting `SPEC` (`routing/policy.py`) and one line in `POLICIES`
below; config validation, prefix data, `gateway replay --policy` and the explain endpoint follow from the spec.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import reduce
from importlib import import_module
from operator import or_
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from gateway.prediction.ttft import TtftCorrector
from gateway.routing.engine import RoutingEngine
from gateway.routing.policy import AnySpec, Policy, PolicyContext, PolicyParams

if TYPE_CHECKING:
    from gateway.settings.routing import Routing  # which imports this module for PolicyConfig


def _spec(module: str) -> AnySpec:
    spec: AnySpec = import_module(f"gateway.routing.policies.{module}").SPEC
    if spec.name != module:
        raise ImportError(f"gateway.routing.policies.{module} registers {spec.name!r}: a policy is named by its module")
    return spec


POLICIES: dict[str, AnySpec] = {s.name: s for s in (
    _spec("prefix_sla_cost"),
    _spec("round_robin"),
    _spec("least_loaded"),
)}
DEFAULT = "prefix_sla_cost"

# routing.policy: one params model per policy, chosen by `type` (mypy sees the base: the union is built at import)
if TYPE_CHECKING:
    PolicyConfig = PolicyParams
else:
    PolicyConfig = Annotated[reduce(or_, (s.params for s in POLICIES.values())), Field(discriminator="type")]


def spec(name: str) -> AnySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})") from None


def params_for(name: str, current: PolicyParams | None = None) -> PolicyParams:
    """`name`'s params: `current` when it is that policy's (a what-if keeps the configured values), else defaults."""
    s = spec(name)
    out: PolicyParams = current if isinstance(current, s.params) else s.params()
    return out


def build_policy(params: PolicyParams, ctx: PolicyContext) -> Policy:
    return spec(params.type).make(params, ctx)


def build_corrector(cfg: Routing, clock: Callable[[], float] = time.monotonic) -> TtftCorrector:
    return TtftCorrector(z=cfg.ttft_quantile_z, per_replica=cfg.replica_correction,
                         replica_half_life_s=cfg.replica_correction_half_life_s, clock=clock)


def build_engine(cfg: Routing, corrector: TtftCorrector | None = None) -> RoutingEngine:
    policy = build_policy(cfg.policy, PolicyContext(chunk_tokens=cfg.chunk_tokens))
    return RoutingEngine(policy, uses_prefix=spec(cfg.policy.type).uses_prefix, chunk_tokens=cfg.chunk_tokens,
                         corrector=corrector or build_corrector(cfg),
                         speculative_ttl_s=cfg.speculative_ttl_s, residency_ttl_s=cfg.residency_ttl_s,
                         queue_drain=cfg.queue_drain, shortest_prefill_first=cfg.shortest_prefill_first)
