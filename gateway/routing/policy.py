"""The routing policy contract. A policy is one module in `routing/policies/` (with a README beside it) exporting
`SPEC`, and one line in `routing/registry.py`; nothing else names it.

- `Policy`: ranks the candidates of one request. Pure and total: no I/O, no clock; every input arrives in the
  `RoutingRequest` and the per-candidate features (`routing/features.py`), so adding an input changes no signature.
- `PolicyParams`: the policy's parameters as a strict pydantic model whose `type` is the policy's name. The routing
  config's `policy:` section is the union of every registered model, discriminated on `type`, so an unknown name or
  a misspelt parameter is refused at load with its location.
- `PolicySpec`: what the registry knows of a policy — its name, its params model, whether it reads prefix data (the
  gateway and `gateway replay` then hash prompts and query the prefix index for it), and how to build it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from gateway.routing.decision import Decision
from gateway.routing.features import Candidate, R
from gateway.routing.request import RoutingRequest
from gateway.typed import Strict


class Policy(Protocol):
    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate[R]], /) -> Decision[R]: ...


class PolicyParams(Strict):
    """Base of every policy's parameters; a subclass narrows `type` to `Literal["<its name>"]`."""

    type: str


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """Routing settings every policy may read besides its own parameters."""

    chunk_tokens: int  # prefix hash granularity: a hit shorter than one chunk is no hit


P = TypeVar("P", bound=PolicyParams)


@dataclass(frozen=True)
class PolicySpec(Generic[P]):
    name: str  # kebab-free snake_case, the value of routing.policy.type
    params: type[P]
    uses_prefix: bool  # False: callers skip hashing and the prefix lookup (the policy never sees matches)
    build: Callable[[P, PolicyContext], Policy]
    summary: str  # one line: what it prefers

    def make(self, params: PolicyParams, ctx: PolicyContext) -> Policy:
        if not isinstance(params, self.params):
            raise TypeError(f"policy {self.name!r} takes {self.params.__name__}, not {type(params).__name__}")
        return self.build(params, ctx)


AnySpec = PolicySpec[Any]
