"""Thin handlers for the OpenAI surface: parse, route, dispatch, respond (all in the proxy)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.api.fastpath import HOT
from gateway.api.openai.proxy import OpenAIProxy
from gateway.errors import ModelNotFound
from gateway.state import AppState

router = APIRouter()


def _state(request: Request) -> AppState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def _proxy(request: Request) -> OpenAIProxy:
    return request.app.state.proxy  # type: ignore[no-any-return]


async def _hot(request: Request) -> Response:
    return await _proxy(request).handle(request, HOT[request.url.path])


# POST on these two is answered by the fast path (api/fastpath.py) before FastAPI sees it; they are declared so that
# any other method is FastAPI's 405 (in the OpenAI shape), and so the FastAPI app alone still serves them.
for _path in HOT:
    router.add_api_route(_path, _hot, methods=["POST"])


def _card(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "inference-gateway"}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    st = _state(request)
    tenant = st.policies.index.identify(request.headers.get("authorization"))
    return JSONResponse({"object": "list", "data": [_card(m) for m in tenant.models]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    st = _state(request)
    tenant = st.policies.index.identify(request.headers.get("authorization"))
    if model_id not in tenant.models:
        raise ModelNotFound(f"The model '{model_id}' does not exist or you do not have access to it.", param="model")
    return JSONResponse(_card(model_id))
