"""HTTP surface of one simulated SGLang server (spec section 2), over a `Replica`: the routes, assembled from the
generation endpoints (sim/generate.py), the read-only ones (sim/info_api.py) and the control ones (sim/control_api.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway_lab.sim.control_api import ControlApi
from gateway_lab.sim.generate import GenerateApi
from gateway_lab.sim.info_api import InfoApi
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.wire import error_response, json_response


def create_sim_app(replica: Replica) -> Starlette:
    gen, info, ctl = GenerateApi(replica), InfoApi(replica), ControlApi(replica)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await replica.start()
        yield
        await replica.stop()

    routes = [
        Route("/v1/chat/completions", gen.chat, methods=["POST"]),
        Route("/v1/completions", gen.completions, methods=["POST"]),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", info.model, methods=["GET"]),
        Route("/health", info.health, methods=["GET"]),
        Route("/health_generate", info.health, methods=["GET"]),
        Route("/ready", info.ready, methods=["GET"]),
        Route("/ping", info.ping, methods=["GET"]),
        Route("/server_info", info.server_info, methods=["GET"]),
        Route("/get_server_info", info.server_info, methods=["GET"]),
        Route("/model_info", info.model_info, methods=["GET"]),
        Route("/get_model_info", info.model_info, methods=["GET"]),
        Route("/v1/loads", info.v1_loads, methods=["GET"]),
        Route("/get_load", info.get_load, methods=["GET"]),
        Route("/flush_cache", info.flush_cache, methods=["GET", "POST"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route("/abort_request", ctl.abort_request, methods=["POST"]),
        Route("/slow_down", ctl.slow_down, methods=["GET", "POST"]),
        Route("/pause_generation", ctl.pause, methods=["POST"]),
        Route("/continue_generation", ctl.resume, methods=["POST"]),
        *[Route(p, ctl.noop, methods=["GET", "POST"]) for p in ("/start_profile", "/stop_profile", "/freeze_gc",
                                                               "/update_weights_from_disk", "/load_lora_adapter")],
        Route("/_sim/config", ctl.sim_config, methods=["GET", "POST"]),
        Route("/_sim/fault", ctl.sim_fault, methods=["POST"]),
        Route("/_sim/state", ctl.sim_state, methods=["GET"]),
        Route("/_sim/kv_events", ctl.sim_kv_events, methods=["GET", "POST"]),
        Route("/v1/tokenize", info.tokenize, methods=["POST"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return json_response({"detail": "Not Found"}, 404)

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return json_response({"detail": "Method Not Allowed"}, 405)

    async def internal_error(request: Request, exc: Exception) -> Response:
        # SGLang answers unexpected exceptions with its envelope, never a traceback.
        return error_response(500, f"Internal server error: {type(exc).__name__}", "InternalServerError")

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, Exception: internal_error})
    app.state.replica = replica
    return app
