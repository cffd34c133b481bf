"""The app factory: a FastAPI app whose dependencies are built in the lifespan from a validated config."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from gateway.api import admin as admin_api
from gateway.api import error_handlers, ops
from gateway.api.fastpath import FastPath
from gateway.api.messages import routes as messages_routes
from gateway.api.middleware import RequestIdMiddleware
from gateway.api.openai import routes as openai_routes
from gateway.api.responses import routes as responses_routes
from gateway.api.responses.store import build_store as build_response_store
from gateway.backends.base import Backend
from gateway.backends.engine_poller import EnginePoller
from gateway.backends.health import HealthChecker
from gateway.backends.hosted import LiteLLMBackend
from gateway.backends.openai_compat import HttpBackend, SGLangBackend
from gateway.backends.polls import PollClient
from gateway.config import GatewayConfig
from gateway.control.plane import ControlPlane
from gateway.control.store import MemoryControlStore, RedisControlStore
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.feedback import Feedback
from gateway.dispatch.outliers import LatencyOutliers, detector_stats
from gateway.dispatch.pd import PdBackend
from gateway.dispatch.quarantine import Quarantine
from gateway.flow.runtime import build as build_flow
from gateway.kvevents.setup import build as build_precise
from gateway.observability.logging import setup_logging
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import build_tracer
from gateway.offload import CpuPool
from gateway.pipeline.pipeline import Pipeline
from gateway.prefix.index import PrefixIndex
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.prefix.redis import RedisPrefixIndex
from gateway.recording.recorder import TraceRecorder
from gateway.routing.load import LoadTracker, MemoryLoadTracker, RedisLoadTracker
from gateway.routing.pipeline import PipelineRouter
from gateway.routing.registry import build_engine
from gateway.secrets import resolve as resolve_secrets
from gateway.shared_redis import RedisGuard, build_client, default_max_connections
from gateway.state import AppState
from gateway.teardown import Step, run_steps
from gateway.tenancy.concurrency import ConcurrencyLimiter
from gateway.tenancy.fallback import build_limits
from gateway.tenancy.idempotency import MemoryIdempotencyStore, RedisIdempotencyStore
from gateway.tenancy.policy_loader import PolicyError
from gateway.tenancy.policy_store import PolicyStore
from gateway.upstreams import UpstreamRegistry

FIRST_POLL_S = 3.0  # how long the start waits for the replicas' first preflight (a hung one must not hold it)
SHUTDOWN_STEP_S = 15.0  # each shutdown step's bound (gateway/teardown.py): past it the step is abandoned and named

def create_app(config: GatewayConfig, *, span_exporter: Any = None, transport: httpx.AsyncBaseTransport | None = None) -> Any:
    """The ASGI app: the hot OpenAI routes as plain ASGI (`api/fastpath.py`), everything else through FastAPI;
    request ids on every response. `.state` is the FastAPI app's state. Tenant policies are loaded here, so an
    invalid policy directory fails the start (ConfigError) before anything listens."""
    policies = PolicyStore(config)
    secrets = resolve_secrets(config)  # every env-named secret now: a missing one fails the start, naming it

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        setup_logging()
        t = config.timeouts
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=4.0)
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=t.connect, read=None, write=30.0, pool=t.connect),
            limits=limits, transport=transport,  # a test's transport, else httpx's own pool with these limits
            trust_env=False,  # upstreams are addressed directly, never through an environment proxy
        )
        registry = UpstreamRegistry(config, secrets.pool_keys)
        metrics = GatewayMetrics()
        policies.on_reload = lambda result: metrics.policy_reloads.labels(result).inc()
        sglang_backend = SGLangBackend(http, config.retry, t.idle, t.connect)
        # vLLM speaks the same plain HTTP/1.1 OpenAI surface: the same lean keep-alive client serves it
        backends: dict[str, Backend] = {"sglang": PdBackend(sglang_backend, config, secrets.pool_keys, metrics.registry),
                                         "vllm": sglang_backend,
                                         "openai": HttpBackend(http, config.retry, t.idle),
                                         "litellm": LiteLLMBackend()}
        tracer, provider = build_tracer(config.observability.tracing_exporter, config.observability.service_name, span_exporter)
        gets = PollClient(http)  # the polls' and probes' GETs: one keep-alive pool per replica, shared
        health = HealthChecker(registry, http, config.health, metrics, gets)
        rc = config.routing
        redis_client = None
        index: PrefixIndex
        loads: LoadTracker
        redis_loads: RedisLoadTracker | None = None
        fell_back = lambda what, reason: metrics.shared_state_fallbacks.labels(what, reason).inc()  # noqa: E731
        if rc.redis_url:
            # a bounded pool that waits for a free connection: saturation is not an outage (shared_redis.py)
            redis_client = build_client(rc.redis_url, password=secrets.redis_password, connect_timeout=rc.redis_timeout_s * 5,
                                        max_connections=rc.redis_max_connections or default_max_connections(rc.expected_inflight),
                                        pool_timeout=rc.redis_pool_timeout_s)
            index = RedisPrefixIndex(redis_client, prefix=rc.redis_prefix, timeout=rc.redis_timeout_s,
                                     on_rtt=metrics.redis_rtt.observe, guard=RedisGuard("prefix index", on_fallback=fell_back,
                                                                                 hung_after=rc.redis_hung_after_s))
            loads = redis_loads = RedisLoadTracker(redis_client, prefix=rc.redis_prefix, timeout=rc.redis_timeout_s,
                                                   guard=RedisGuard("load", on_fallback=fell_back,
                                                                    hung_after=rc.redis_hung_after_s))
            redis_loads.start()
            control_store: MemoryControlStore | RedisControlStore = RedisControlStore(
                redis_client, rc.redis_prefix, timeout=rc.control_redis_timeout_s)
        else:
            index, loads = MemoryPrefixIndex(), MemoryLoadTracker()
            control_store = MemoryControlStore()
        precise, approximate = None, index
        if rc.mode != "approximate":  # KV-event routing (docs/kv-events.md): the precise index wraps this one
            precise = build_precise(rc, registry, http, index, metrics.registry)
            index = precise.index
        limiter, budget = build_limits(redis_client, rc, fell_back)  # settlements Redis missed are queued and replayed
        metrics.settlements_pending.set_function(lambda: len(budget.pending))

        async def reload_event(ev: dict[str, Any]) -> None:
            try:
                policies.reload(str(ev.get("who") or "reload event"))  # audited once, under who asked
            except PolicyError:
                pass  # logged and kept in policies.last_error; the running policy stays

        async def flush_event(ev: dict[str, Any]) -> None:
            # "key": an instance of the release before ranks were flushed
            await feedback.flushed([str(key) for key in ev.get("keys") or [ev["key"]]])

        control = ControlPlane(control_store, registry, config.admin.control_resync_s,
                               actions={"reload": reload_event, "flush": flush_event}, policies=policies)
        engine = build_engine(rc)  # one routing engine: the decision and the feedback rules (routing/engine.py)
        corrector = engine.corrector
        router = PipelineRouter(registry, index, loads, engine, on_lookup=metrics.routing_lookup.observe)
        # the one writer of the index and load: request outcomes, the poller's facts, flushes, KV events; it also
        # records what each replica was observed to do, for the latency outlier detector
        od = config.outlier_detection
        outliers = LatencyOutliers(od, detector_stats(od), lambda: registry.by_pool, metrics=metrics,
                                   corrector=corrector)
        feedback = Feedback(index, loads, engine, metrics, rc, reservations=router.reservations, approximate=approximate,
                            outliers=outliers)
        if precise is not None:
            precise.manager.feedback = feedback
        recorder = TraceRecorder(config.recording, rc.chunk_tokens)  # off unless recording.path is set
        poller = EnginePoller(registry, http, feedback, rc.chunk_tokens, rc.load_poll_s, config, metrics.registry, gets)
        state = AppState(
            config=config, registry=registry, policies=policies, control=control, limiter=limiter, budget=budget,
            metrics=metrics, http=http,
            backends=backends, router=router, dispatcher=Dispatcher(
                config, backends, metrics, feedback, tracer=tracer, on_unreachable=health.unreachable,
                quarantine=Quarantine(config.retry.quarantine_ttl_s, redis_client, rc.redis_prefix, rc.redis_timeout_s)),
            health=health, feedback=feedback, tracer=tracer, tracer_provider=provider,
            concurrency=ConcurrencyLimiter(redis_client, rc.redis_prefix, rc.concurrency_lease_s, rc.limits_redis_timeout_s,
                                           RedisGuard("concurrency caps", on_fallback=fell_back,
                                                      hung_after=rc.redis_hung_after_s)),
            index=index, loads=loads, corrector=corrector, poller=poller, admin_hashes=secrets.admin_hashes, recorder=recorder,
            cpu=CpuPool(config.offload, metrics),
        )
        if precise is not None:
            state.prefix_hasher, state.kv_events = precise.hasher, precise.manager
        state.idempotency = RedisIdempotencyStore(redis_client, rc.redis_prefix, config.idempotency.ttl_s) \
            if redis_client is not None else MemoryIdempotencyStore(config.idempotency.ttl_s)
        if config.flow.enabled:  # flow control between admission and routing (gateway/flow/)
            state.flow = build_flow(config.flow, router.decide, router.reservations.release, metrics.registry,
                                    redis_client, rc.redis_prefix, rc.redis_timeout_s,
                                    RedisGuard("flow", on_fallback=fell_back, hung_after=rc.redis_hung_after_s),
                                    router.reservations.reserve)
            state.flow.start()
            outliers.waiting = state.flow.waiting_for  # no latency ejection from a saturated pool
        app.state.gateway = state
        app.state.proxy = Pipeline(state)
        app.state.responses_store = build_response_store(config.responses, redis_client, rc.redis_prefix,
                                                         rc.limits_redis_timeout_s)
        health.start()
        budget.start()
        state.concurrency.start()
        if config.health.enabled:
            await poller.first_poll(FIRST_POLL_S)
            poller.start()
        if precise is not None:
            precise.manager.start()
        policies.start()
        await control.start()
        try:
            yield
        finally:
            steps: list[Step] = [
                ("control", control.stop), ("policies", policies.stop),
                *([("flow", state.flow.stop)] if state.flow is not None else []),
                ("pipeline drain", app.state.proxy.drain), ("concurrency", state.concurrency.stop),
                ("health", health.stop), ("engine poller", poller.stop), ("poll client", gets.close),
                *([("kv events", precise.manager.stop)] if precise is not None else []),
                ("feedback", feedback.drain), ("recorder", recorder.close),
                ("budget", budget.stop),  # after the pipeline's settlements: a last replay of anything still queued
                ("quarantine", state.dispatcher.quarantine.drain),
                *([("redis loads", redis_loads.stop)] if redis_loads is not None else []),
                *([("redis", redis_client.aclose)] if redis_client is not None else []),
                ("http client", http.aclose), ("sglang backend", sglang_backend.close), ("cpu pool", state.cpu.close),
                *([("tracing", provider.shutdown)] if provider is not None else []),
            ]
            await run_steps(steps, SHUTDOWN_STEP_S)

    app = FastAPI(title="inference-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(messages_routes.router)
    app.include_router(ops.router)
    if config.admin.on_client_port:  # a single-port setup that keeps its client port private itself
        app.include_router(ops.metrics_router)
        app.include_router(admin_api.router)
    error_handlers.install(app)
    return RequestIdMiddleware(FastPath(app))


def create_admin_app(main: Any) -> Any:
    """The admin listener's app (`admin.host`:`admin.port`): the admin API, /metrics and the probes, over the main
    app's state, so both listeners see and change the same instance. The client port serves none of it."""
    admin = FastAPI(title="inference-gateway-admin", docs_url=None, redoc_url=None, openapi_url=None)
    admin.include_router(ops.router)
    admin.include_router(ops.metrics_router)
    admin.include_router(admin_api.router)
    error_handlers.install(admin)
    admin.state.main = main
    return RequestIdMiddleware(admin)
