"""Thin handlers for the OpenAI surface: the chat and completions routes hand the request to the pipeline (pipeline/),
which parses, routes, dispatches and responds; `/v1/models` lists what the key may use."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.api.fastpath import HOT
from gateway.errors import ModelNotFound
from gateway.pipeline.pipeline import Pipeline
from gateway.state import AppState

router = APIRouter()


def _state(request: Request) -> AppState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def _proxy(request: Request) -> Pipeline:
    return request.app.state.proxy  # type: ignore[no-any-return]


async def _hot(request: Request) -> Response:
    return await _proxy(request).handle(request, HOT[request.url.path])


# POST on these two is answered by the fast path (api/fastpath.py) before FastAPI sees it; they are declared so that
# any other method is FastAPI's 405 (in the OpenAI shape), and so the FastAPI app alone still serves them.
for _path in HOT:
    router.add_api_route(_path, _hot, methods=["POST"])


def _card(name: str, served: str | None = None) -> dict[str, object]:
    card: dict[str, object] = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "inference-gateway"}
    if served is not None:
        card["root"] = served  # an alias: the served model that answers it
    return card


def _key(request: Request) -> str | None:
    """Bearer, or Anthropic clients' `x-api-key`."""
    auth = request.headers.get("authorization")
    if auth is None and request.headers.get("x-api-key"):
        return f"Bearer {request.headers['x-api-key']}"
    return auth


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The tenant's models, then its exact aliases (a glob names no one model; `GET /v1/models/{name}` answers any
    name a glob matches)."""
    st = _state(request)
    tenant = st.policies.index.identify(_key(request))
    cards = [_card(m) for m in tenant.models]
    cards += [_card(a.match, a.model) for a in tenant.model_aliases if not a.is_glob and a.match not in tenant.models]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    st = _state(request)
    tenant = st.policies.index.identify(_key(request))
    if model_id in tenant.models:
        return JSONResponse(_card(model_id))
    alias = tenant.alias_for(model_id)
    if alias is None:
        raise ModelNotFound(f"The model '{model_id}' does not exist or you do not have access to it.", param="model")
    return JSONResponse(_card(model_id, alias.model))
