"""The app's typed state, built in the lifespan (nothing happens at import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.backends.base import Backend
from gateway.backends.health import HealthChecker
from gateway.config import GatewayConfig
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.feedback import Feedback
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.pipeline import Router
from gateway.control.plane import ControlPlane
from gateway.tenancy.budget import BudgetLedger
from gateway.tenancy.concurrency import ConcurrencyLimiter
from gateway.tenancy.policy_store import PolicyStore
from gateway.tenancy.ratelimit import RateLimiter
from gateway.upstreams import UpstreamRegistry


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
    tracer: Any
    tracer_provider: Any = None
    draining: bool = False
    concurrency: ConcurrencyLimiter = field(default_factory=ConcurrencyLimiter)  # tenants' max_concurrent
    extra: dict[str, Any] = field(default_factory=dict)
