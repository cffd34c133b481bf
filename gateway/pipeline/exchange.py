"""One client request's record: what it asked and what the stages before dispatch returned (its outcome: outcome.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gateway.config import ModelRoute
from gateway.pipeline.call import PLAIN, Call
from gateway.pipeline.idempotency import Held
from gateway.pipeline.validation import ParsedRequest
from gateway.policy_schema import Tenant
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest
from gateway.tenancy.budget import Reservation
from gateway.tenancy.concurrency import Slot
from gateway.tenancy.ratelimit import Bucket
from gateway.upstreams import Target


@dataclass
class Exchange:
    """One request's record, in two parts by who writes them. What was asked: set once by `Pipeline.begin`. What
    the stages before dispatch returned (admission's slot and buckets, the span, the routing request and decision,
    the reservation, the held Idempotency-Key, the response headers they owe the client): assigned by the
    orchestrator (pipeline.py), never by a stage. Complete when `Pipeline.admit` returns: nothing writes it after
    that. What is learned as the answer arrives is the request's `Outcome` (outcome.py), a value of its own;
    accounting reads the two together, once, at the end.
    `request_id` is the correlation id (the client's x-request-id when sane, else minted), `id` the gateway's own."""

    # -- what was asked (Pipeline.begin) --
    request_id: str
    tenant: Tenant
    endpoint: str
    parsed: ParsedRequest
    route: ModelRoute
    started: float
    deadline: float
    call: Call = PLAIN  # the API adapter's: API label, agent session, stored turn's replica (pipeline/call.py)
    flow_band: str | None = None  # the client's x-gateway-band: honoured only for bands its policy lists
    body_bytes: int = 0  # the client's body size: large ones are hashed and tokenized off the event loop
    # The gateway's own id for this request, never the client's: it keys what costs money or holds capacity (the
    # budget reservation and its settlement, the routing load reservation, the upstream's x-request-id). The
    # client's x-request-id (`request_id`) is only a correlation field: logged and echoed, never a key.
    id: str = field(default_factory=lambda: os.urandom(16).hex())
    # -- what the stages returned (assigned by the orchestrator) --
    slot: Slot | None = None  # the tenant's concurrency slot, released by accounting
    buckets: list[Bucket] = field(default_factory=list)  # rate-limit buckets this request was admitted on
    span: Any = None
    rreq: RoutingRequest | None = None
    decision: Decision[Target] | None = None
    engine_boost: int = 0  # flow control's addition to the engine priority (pipeline/flow.py: Passed.boost)
    reservation: Reservation | None = None  # budget held until the usage is known
    idem: Held | None = None  # the client's Idempotency-Key this request holds (pipeline/idempotency.py), if any
    headers: dict[str, str] = field(default_factory=dict)  # the response headers the stages owe the client


@dataclass(frozen=True)
class RecentDecision:
    at: float
    request_id: str
    tenant: str
    model: str
    status: str
    served_by: str | None
    attempts: int
    decision: Decision[Target] | None
    request: RoutingRequest | None = None  # what was routed (chunk hashes, no text): admin previews re-decide it
    ttft_s: float | None = None  # observed time to the first token (streams only: a whole response is not a TTFT)
    prompt_tokens: int | None = None  # upstream usage, for the console's hit rate per replica
    cached_tokens: int | None = None

    def explain(self) -> dict[str, Any]:
        return {"at": self.at, "request_id": self.request_id, "tenant": self.tenant, "model": self.model,
                "status": self.status, "served_by": self.served_by, "attempts": self.attempts, "ttft_s": self.ttft_s,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "decision": self.decision.explain() if self.decision else None}
