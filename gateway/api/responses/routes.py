"""POST /v1/responses (+ GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items): the OpenAI
Responses API bridged onto the chat path (`gateway/api/chat_bridge.py`). Errors keep the OpenAI shape, which the
Responses API shares with chat, so the gateway's error handlers render them."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gateway.api.chat_bridge import (
    Ending,
    TranslatedStream,
    json_body,
    note_refusal,
    passthrough_headers,
    read_json,
    session_of,
)
from gateway.api.dropped import HEADER
from gateway.api.responses.affinity import served_by
from gateway.api.responses.front import ResponsesPolicy, responses_front
from gateway.api.responses.native import NativeResponses, is_native
from gateway.api.responses.output import from_chat, history_of
from gateway.api.responses.store import ResponseStore
from gateway.api.responses.stream import ResponsesStream
from gateway.api.responses.translate import ResponsesRequest, new_id, parse_request
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound, UpgradeRequired
from gateway.pipeline.body import read_body
from gateway.pipeline.call import Call
from gateway.pipeline.front import Names
from gateway.pipeline.json_body import MAX_JSON_DEPTH
from gateway.policy_schema import Tenant
from gateway.state import AppState
from gateway.tokenizers import prompt_tokens

router = APIRouter()
SESSION_HEADERS = ("session_id", "session-id", "conversation_id", "conversation-id")  # Codex and other agents
_ID = re.compile(r"^resp_[A-Za-z0-9]{1,64}$")


class ResponseNotFound(GatewayError):
    """404 for an id this tenant has no stored response under (expired, deleted, never stored, or another's)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _ctx(request: Request) -> tuple[AppState, Any, ResponseStore, str]:
    st: AppState = request.app.state.gateway
    tenant = st.policies.index.identify(request.headers.get("authorization"))
    return st, request.app.state.proxy, request.app.state.responses_store, tenant.name


def pool_kinds(st: AppState, model: Any, pin: str | None) -> frozenset[str]:
    """The kinds of the pools that may serve `model`: its route's, or only the pinned one (empty: unknown model,
    which the chat path refuses anyway)."""
    route = next((m for m in st.config.models if m.name == model), None)
    if route is None:
        return frozenset()
    names = [pin] if pin in route.pools else route.pools
    return frozenset(st.config.pool(n).kind for n in names)


def _check_id(resp_id: str, param: str | None = None) -> None:
    """Ids are the gateway's own (`resp_<hex>`): anything else names no stored response (and never reaches a key)."""
    if not _ID.match(resp_id):
        raise ResponseNotFound(f"No response found with id '{resp_id[:128]}'.", param=param)


async def _load_raw(store: ResponseStore, tenant: str, resp_id: str, param: str | None = None) -> bytes:
    """The store's record of a turn, as stored (404 for an id this tenant has none under)."""
    _check_id(resp_id, param)
    raw = await store.get(tenant, resp_id)
    if raw is None:
        raise ResponseNotFound(f"No response found with id '{resp_id}'.", param=param)
    return raw


async def _load(store: ResponseStore, tenant: str, resp_id: str, param: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = orjson.loads(await _load_raw(store, tenant, resp_id, param))
    return rec


async def _store(store: ResponseStore, tenant: str, req: ResponsesRequest, history: list[dict[str, Any]],
                 response: dict[str, Any], replica: str | None, items_json: bytes | None = None) -> None:
    """`items_json`: the turn's items (history, then this turn's input) as JSON, encoded in the worker process that
    worked on a large body (responses/front.py): spliced in as they are, the same bytes."""
    if req.store:
        items: Any = orjson.Fragment(items_json) if items_json is not None else history + req.input_items
        await store.put(tenant, response["id"], orjson.dumps({"response": response, "input_items": items,
                                                              "served_by": served_by(replica, response)}))


def _openai_error(status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> Response:
    resp = _json(body or {"error": {"message": "upstream error", "type": "server_error", "param": None,
                                    "code": None}}, status)
    resp.raw_headers.extend(headers)
    return resp


@router.get("/v1/responses")
async def websocket_handshake(request: Request) -> Response:
    """Codex CLI opens the Responses API as a WebSocket first (GET with `Upgrade: websocket`). The key is checked
    first, as everywhere (a bad one: 401, which ends the client's run at once); a good one gets 426 with nothing
    else done, and the client falls back to `POST /v1/responses` over HTTP on the spot rather than retrying the
    handshake. A GET without the upgrade is a method this path does not serve (405)."""
    _ctx(request)  # 401 for a missing or unknown key
    if request.headers.get("upgrade", "").lower() == "websocket":
        raise UpgradeRequired("This gateway serves the Responses API over HTTP: POST /v1/responses. WebSocket is "
                              "not supported.", should_retry=False)
    raise HTTPException(405)  # rendered in the OpenAI shape like any other method a /v1 path does not serve


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    st, proxy, store, tenant = _ctx(request)
    policy = st.policies.index.tenants[tenant]
    seen: dict[str, Any] = {}  # the body's model, once read
    try:
        return await _create(request, st, proxy, store, policy, seen)
    except GatewayError as e:
        if not request.scope.get("state", {}).get("accounted"):  # refused before the chat path: log what was read
            note_refusal(request, seen.get("model"), e, policy.served(seen.get("model")))
        raise


# (id(config), pool pin) -> (config, each model's pool kinds, the models served natively): a config is immutable
# once loaded, so these are worked out once per config and pin, not per request
_BY_CONFIG: dict[tuple[int, str | None], tuple[Any, dict[str, frozenset[str]], frozenset[str]]] = {}


def _policy(st: AppState, proxy: Any, request: Request, policy: Tenant, size: int) -> ResponsesPolicy:
    """What the translation of `size` bytes (the body and any stored turn it continues) needs of this tenant, the
    config and the request's pool pin, as plain data."""
    pin = request.headers.get("x-gateway-pool")
    hit = _BY_CONFIG.get((id(st.config), pin))
    if hit is None or hit[0] is not st.config:
        if len(_BY_CONFIG) > 256:  # pins are the client's to send: start again
            _BY_CONFIG.clear()
        hit = _BY_CONFIG[(id(st.config), pin)] = (
            st.config, {m.name: pool_kinds(st, m.name, pin) for m in st.config.models},
            frozenset(m.name for m in st.config.models if is_native(st, m.name)))
    return ResponsesPolicy(Names.of(policy), policy.hosted_tools, policy.client_metadata,
                           st.config.responses.auto_truncate_input_tokens, hit[1], hit[2],
                           proxy.hashing(st.control.effective(policy), size))


async def _create(request: Request, st: AppState, proxy: Any, store: ResponseStore, policy: Tenant,
                  seen: dict[str, Any]) -> Response:
    tenant = policy.name
    # the stored turn parsed, translated, validated, hashed: one function, in a worker process for a large body
    # (responses/front.py); run again with the stored turn when the body continues one
    raw = await read_body(request, st.config.body_limit("responses"))
    size = len(raw)
    res = await st.cpu.front(raw, MAX_JSON_DEPTH, responses_front, None, _policy(st, proxy, request, policy, size))
    seen["model"] = res.model
    if res.need_history:
        assert res.previous is not None
        stored = await _load_raw(store, tenant, res.previous, "previous_response_id")
        # the stored turn counts: a small body continuing a long conversation is large work (here and in the
        # pipeline's later steps: a tokenizer's hashing)
        size += len(stored)
        res = await st.cpu.front(raw, MAX_JSON_DEPTH, responses_front, stored,
                                 _policy(st, proxy, request, policy, size), size=size)
    if res.error is not None:
        raise res.error
    # the API label; the agent session (Codex sends its session id as prompt_cache_key and in headers): one cold
    # placement; the replica that served the stored turn: routing's floor
    call = Call(api="responses", affinity=res.affinity, body_bytes=size,
                session=session_of(res.session, *(request.headers.get(h) for h in SESSION_HEADERS)))
    if res.native is not None:
        return await NativeResponses(request, proxy, store, tenant, res.native, res.history, call).handle()
    req, history, dropped = res.req, res.history, res.dropped
    assert req is not None
    dropped.report(st.metrics, "responses", request.scope.get("state", {}).get("request_id"))
    resp_id, created = new_id("resp"), int(time.time())
    translator = ResponsesStream(resp_id, req)
    encoder = Ending(translator)  # streamed: the relay writes Responses events from each chunk
    call = replace(call, front=res.front)
    out: Response = await proxy.handle(request, "chat/completions", body=req.chat,
                                       call=replace(call, encoder=encoder) if req.stream else call)
    if req.stream:

        async def on_end() -> None:
            if translator.final is not None:
                await _store(store, tenant, req, history, translator.final, stream.header(b"x-gateway-replica"),
                             res.items_json)

        stream = TranslatedStream(out, encoder, _openai_error, on_end)
        if dropped:
            stream.extra_headers.append((HEADER.encode(), dropped.header().encode()))
        return stream
    chat = json_body(out)
    if chat is None:
        return out  # 499: the client is gone
    response = from_chat(chat, resp_id, created, int(time.time()), req)
    await _store(store, tenant, req, history, response, out.headers.get("x-gateway-replica"), res.items_json)
    headers = passthrough_headers(out)
    if dropped:
        headers[HEADER] = dropped.header()
    return _json(response, headers=headers)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(request: Request) -> Response:
    """The prompt a create with this body would send (history expanded), counted by the model's tokenizer where the
    gateway has loaded it (precise/hybrid routing), else by the shared 4-characters rule; only for a model this key
    may use."""
    st, _, store, tenant = _ctx(request)
    body, size = await read_json(request, st.config.body_limit("responses"), st.cpu)
    history: list[dict[str, Any]] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str) or not prev:
            raise InvalidRequest("'previous_response_id' must be a non-empty string.", param="previous_response_id")
        history = history_of(await _load(store, tenant, prev, "previous_response_id"))
    req = await st.cpu.run(size, parse_request, {"input": [], **body, "stream": False}, history,
                           st.config.responses.auto_truncate_input_tokens, allow_empty_input=True)
    if st.policies.index.tenants[tenant].served(req.model) is None:  # a model (or alias) this key may use
        raise ModelNotFound(f"The model '{req.model}' does not exist or you do not have access to it.", param="model")
    tokenizer = st.kv_events.tokenizer if st.kv_events is not None else None
    return _json({"object": "response.input_tokens",
                  "input_tokens": await st.cpu.run(size, prompt_tokens, tokenizer, req.chat)})


@router.get("/v1/responses/{resp_id}")
async def get_response(resp_id: str, request: Request) -> Response:
    _, _, store, tenant = _ctx(request)
    return _json((await _load(store, tenant, resp_id))["response"])


@router.delete("/v1/responses/{resp_id}")
async def delete_response(resp_id: str, request: Request) -> Response:
    _, _, store, tenant = _ctx(request)
    _check_id(resp_id)
    if not await store.delete(tenant, resp_id):
        raise ResponseNotFound(f"No response found with id '{resp_id}'.")
    return _json({"id": resp_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{resp_id}/input_items")
async def list_input_items(resp_id: str, request: Request) -> Response:
    """The turn's input items (its history included), newest first unless order=asc; `after` and `limit` page."""
    _, _, store, tenant = _ctx(request)
    items = list((await _load(store, tenant, resp_id))["input_items"])
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    raw_limit = q.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
    if order == "desc":
        items.reverse()
    after = q.get("after")
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise InvalidRequest(f"No input item with id '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[: int(raw_limit)]
    return _json({"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                  "last_id": page[-1].get("id") if page else None, "has_more": len(items) > len(page)})
