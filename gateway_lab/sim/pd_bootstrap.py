"""The prefill server's bootstrap server, as SGLang runs it beside a prefill server in PD (sim/pd.py holds the
rooms and the KV fabric the transfer itself goes through)."""

from __future__ import annotations

from typing import Any


def create_bootstrap_app(replica: Any) -> Any:
    """The prefill server's bootstrap server (SGLang's CommonKVBootstrapServer, on --disaggregation-bootstrap-port):
    `/health` answers OK; `/route?engine_rank=-1` gives the prefill side's parallel layout, which a decode server
    (and `gateway check`) compares with its own. The simulator's transfer itself goes through the fabric."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    async def health(request: Request) -> Response:
        return PlainTextResponse("OK")

    async def route(request: Request) -> Response:
        cfg = replica.cfg
        return JSONResponse({"prefill_attn_tp_size": cfg.tp_size, "prefill_dp_size": cfg.dp_size,
                             "prefill_pp_size": 1, "prefill_page_size": cfg.page_size,
                             "prefill_kv_cache_dtype": cfg.kv_cache_dtype,
                             "transfer_backend": cfg.disaggregation_transfer_backend,
                             "follow_bootstrap_room": True})

    return Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/route", route, methods=["GET"])])
