"""POST /v1/messages (+ /v1/messages/count_tokens): the Anthropic Messages API bridged onto the chat path
(`gateway/api/chat_bridge.py`). Keys are the tenants' own, sent as `x-api-key` (Anthropic clients) or
`Authorization: Bearer`, and checked before the body is read, like every other endpoint. Every error, the chat
path's included, is rendered in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), with 529
where the chat path says 503; what the bridge left out of a served request is named in `x-gateway-dropped`."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.chat_bridge import (
    Ending,
    TranslatedStream,
    call_chat,
    json_body,
    note_refusal,
    passthrough_headers,
    read_front,
    read_json,
    session_of,
    with_bearer,
)
from gateway.api.dropped import HEADER
from gateway.api.messages.front import MessagesPolicy, messages_front
from gateway.api.messages.output import error_body, error_status, from_chat, from_gateway_error
from gateway.api.messages.stream import MessagesStream
from gateway.api.messages.translate import to_chat
from gateway.errors import GatewayError, ModelNotFound
from gateway.pipeline.call import Call
from gateway.pipeline.front import Names
from gateway.policy_schema import Tenant
from gateway.state import AppState
from gateway.tokenizers import prompt_tokens

router = APIRouter()


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error(err: GatewayError, request: Request) -> Response:
    status, body = from_gateway_error(err)
    rid = request.scope.get("state", {}).get("request_id")
    if rid:
        body["request_id"] = rid
    return _json(body, status, err.headers())


def _render_stream_error(status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> Response:
    """A chat-path error before the stream committed (OpenAI-shaped) as an Anthropic error."""
    err: dict[str, Any] = body["error"] if isinstance(body.get("error"), dict) else {}
    resp = _json(error_body(status, str(err.get("message") or "upstream error")), error_status(status))
    resp.raw_headers.extend(headers)
    return resp


def _api_key(request: Request) -> str | None:
    """`x-api-key` when the client sent no Bearer token (the chat path reads only `authorization`)."""
    if request.headers.get("authorization"):
        return None
    return request.headers.get("x-api-key")


def _tenant(st: AppState, request: Request) -> Tenant:
    """The key's tenant (401 first, whatever the body holds)."""
    key = _api_key(request)
    return st.policies.index.identify(f"Bearer {key}" if key else request.headers.get("authorization"))


def _takes_images(request: Request, tenant: Tenant, model: object) -> bool:
    """Whether the model this key reaches by `model` takes images (its route's `vision`); a name it cannot reach
    answers true here and is refused by the chat path with its own 404."""
    if not isinstance(model, str):
        return True
    try:
        return bool(request.app.state.proxy.route_for(tenant, model).vision)
    except GatewayError:
        return True


def _policy(st: AppState, request: Request, tenant: Tenant, size: int) -> MessagesPolicy:
    """What the translation of a `size`-byte body needs of this tenant and its routes, as plain data: whether each
    model it serves takes images (`_takes_images`, worked out here: the route is live state)."""
    names = Names.of(tenant)
    vision = {m: _takes_images(request, tenant, m) for m in names.models}
    return MessagesPolicy(names, tenant.hosted_tools, tenant.client_metadata, vision,
                          request.app.state.proxy.hashing(st.control.effective(tenant), size))


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    st: AppState = request.app.state.gateway
    model: str | None = None
    tenant: Tenant | None = None
    try:
        tenant = identified = _tenant(st, request)
        # translate, estimate, validate, hash: one function, in a worker process for a large body (messages/front.py)
        res, size = await read_front(request, st.config.body_limit("messages"), st.cpu, messages_front,
                                     lambda n: _policy(st, request, identified, n))
        model = res.model
        if res.error is not None:
            raise res.error
    except GatewayError as e:
        note_refusal(request, model, e, tenant.served(model) if tenant else None)
        return _error(e, request)
    chat, dropped = res.chat, res.dropped
    assert chat is not None
    stops = chat.get("stop")
    rid = request.scope.get("state", {}).get("request_id")
    dropped.report(st.metrics, "messages", rid)
    # streamed: the relay writes Anthropic events from each chunk
    encoder = Ending(MessagesStream(chat["model"], res.estimate, stops)) if chat["stream"] else None
    session = session_of(request.headers.get("x-claude-code-session-id"), res.session)
    try:
        out = await call_chat(request.app.state.proxy, with_bearer(request, _api_key(request)), chat,
                              Call(api="messages", session=session, body_bytes=size, encoder=encoder, front=res.front))
    except GatewayError as e:  # accounted by the chat path
        return _error(e, request)
    if encoder is not None:
        stream = TranslatedStream(out, encoder, _render_stream_error)
        if dropped:
            stream.extra_headers.append((HEADER.encode(), dropped.header().encode()))
        return stream
    result = json_body(out)
    if result is None:
        return out  # 499: the client is gone
    headers = passthrough_headers(out)
    if dropped:
        headers[HEADER] = dropped.header()
    return _json(from_chat(result, chat["model"], stops), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model's tokenizer counts them where the gateway has loaded it (precise/hybrid
    routing with `routing.kv_events.tokenizer`; chat template applied), else the shared 4-characters rule; only
    for a model (or alias) this key may use, like a real request."""
    st: AppState = request.app.state.gateway
    body: dict[str, Any] = {}
    tenant: Tenant | None = None
    try:
        tenant = _tenant(st, request)
        body, size = await read_json(request, st.config.body_limit("messages"), st.cpu)
        chat = await st.cpu.run(size, to_chat, body, count_only=True, hosted_tools=tenant.hosted_tools,
                                images=_takes_images(request, tenant, body.get("model")))
        if tenant.served(chat["model"]) is None:
            raise ModelNotFound(f"model: {chat['model']}", param="model")
        n = await st.cpu.run(size, prompt_tokens, st.kv_events.tokenizer if st.kv_events is not None else None, chat)
    except GatewayError as e:
        note_refusal(request, body.get("model"), e, tenant.served(body.get("model")) if tenant else None)
        return _error(e, request)
    return _json({"input_tokens": n})
