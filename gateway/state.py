"""The app's typed state, built in the lifespan (nothing happens at import). Every part is a named, typed field:
nothing is looked up by string key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from gateway.backends.base import Backend
from gateway.backends.health import HealthChecker
from gateway.config import GatewayConfig, Offload
from gateway.control.plane import ControlPlane
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.feedback import Feedback
from gateway.flow.runtime import FlowGate
from gateway.observability.metrics import GatewayMetrics
from gateway.offload import CpuPool
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.hashing import prefix_hashes
from gateway.prefix.index import PrefixIndex
from gateway.routing.load import LoadTracker
from gateway.routing.pipeline import Router
from gateway.tenancy.budget import BudgetLedger
from gateway.tenancy.concurrency import ConcurrencyLimiter
from gateway.tenancy.policy_store import PolicyStore
from gateway.tenancy.ratelimit import RateLimiter
from gateway.upstreams import UpstreamRegistry

if TYPE_CHECKING:
    from gateway.backends.engine_poller import EnginePoller
    from gateway.kvevents.manager import KvEventsManager
    from gateway.recording.recorder import TraceRecorder
    from gateway.tenancy.idempotency import IdempotencyStore


@dataclass
class AppState:
    config: GatewayConfig
    registry: UpstreamRegistry
    policies: PolicyStore
    control: ControlPlane
    limiter: RateLimiter
    budget: BudgetLedger
    metrics: GatewayMetrics
    http: httpx.AsyncClient
    backends: dict[str, Backend]
    router: Router
    dispatcher: Dispatcher
    health: HealthChecker
    feedback: Feedback
    tracer: Any  # an OpenTelemetry Tracer (the API's types are not exported for static checking)
    index: PrefixIndex  # the router's prefix index (the precise index around it in routing.mode precise/hybrid)
    loads: LoadTracker  # the gateways' own in-flight counts per target (Redis-shared or this instance's)
    corrector: TtftCorrector  # the routing engine's learned TTFT correction, per pool and load regime
    poller: EnginePoller  # engine loads and server facts (/v1/loads, /server_info, preflight)
    admin_hashes: list[str] = field(default_factory=list)  # admin token digests (config + env); empty: admin API off
    # request -> prefix keys: text chunks (approximate) or token pages (precise/hybrid, gateway/kvevents)
    prefix_hasher: Callable[..., list[int]] = prefix_hashes
    kv_events: KvEventsManager | None = None  # routing.mode precise/hybrid only
    recorder: TraceRecorder | None = None  # recording.path: anonymized traffic for `gateway replay`
    tracer_provider: Any = None
    draining: bool = False
    concurrency: ConcurrencyLimiter = field(default_factory=ConcurrencyLimiter)  # tenants' max_concurrent
    flow: FlowGate | None = None  # flow control between admission and routing (flow.enabled)
    idempotency: IdempotencyStore | None = None  # clients' Idempotency-Key outcomes (tenancy/idempotency.py)
    cpu: CpuPool = field(default_factory=lambda: CpuPool(Offload()))  # large bodies' CPU steps (offload.py)
