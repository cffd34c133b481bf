"""The front half of a Responses request, one function of its parsed body, the stored turn it continues (as the
store's bytes) and plain data (`responses_front`): the stored turn parsed into history, the native-or-bridged
choice, the translation to the chat form (`parse_request`), then the chat path's own front half (pipeline/front.py
`prepare`: validated, rendered, hashed). The route runs it inline for a small body and in a worker process for a
large one (gateway/offload.py `CpuPool.front`). A body that continues a stored turn comes back first asking for it
(`need_history`): the route loads it from the store and runs the function again with it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from gateway.api.chat_bridge import session_of
from gateway.api.dropped import Dropped
from gateway.api.responses.affinity import affinity_of
from gateway.api.responses.output import history_of
from gateway.api.responses.translate import ResponsesRequest, parse_request
from gateway.errors import GatewayError, InvalidRequest
from gateway.pipeline.front import Front, Hashing, Names, bounded_model, prepare
from gateway.pipeline.json_body import bulk_lists


@dataclass(frozen=True, slots=True)
class ResponsesPolicy:
    """What the translation needs of the tenant, the config and the request's pool pin, as plain data."""

    names: Names
    hosted_tools: str
    client_metadata: str
    auto_truncate_tokens: int
    kinds: dict[str, frozenset[str]]  # model -> the kinds of the pools that may serve it (routes.pool_kinds)
    native: frozenset[str]  # models whose pools serve Responses themselves
    hashing: Hashing | None


@dataclass(slots=True)
class ResponsesFront:
    model: str | None  # the body's `model` (bounded), for the log line of a refusal
    error: GatewayError | None = None
    previous: str | None = None  # previous_response_id
    need_history: bool = False  # run again with the stored turn `previous` names
    session: str | None = None  # prompt_cache_key, as session_of takes it
    affinity: tuple[str, int] | None = None  # the replica that served the stored turn
    native: dict[str, Any] | None = None  # the body, for a model served natively (api/responses/native.py)
    history: list[dict[str, Any]] = field(default_factory=list)  # a native turn's, or a stored bridged turn's
    req: ResponsesRequest | None = None  # its input_items only for a turn that is stored
    # a stored turn's items (history + input_items) as the store's JSON, encoded in the worker process; the lists
    # themselves then stay there (`encode_bulk`)
    items_json: bytes | None = None
    dropped: Dropped = field(default_factory=Dropped)
    front: Front | None = None

    def bulk_lists(self) -> list[list[Any]]:
        lists = [self.history]
        if self.native is not None:
            lists += bulk_lists(self.native)
        if self.req is not None:
            lists += bulk_lists(self.req.chat) + [self.req.input_items]
        return lists

    def encode_bulk(self) -> None:
        """In the worker process, before the result is sent back (json_body.run_front_sliced): a stored turn's
        items as the store's JSON, in place of the lists themselves (the event loop only stores them)."""
        if self.req is not None and self.req.store:
            try:
                self.items_json = orjson.dumps(self.history + self.req.input_items)
            except orjson.JSONEncodeError:  # not expected of parsed JSON; the route encodes them as before
                return
            self.history, self.req = [], replace(self.req, input_items=[])


def responses_front(body: dict[str, Any], stored: bytes | None, policy: ResponsesPolicy) -> ResponsesFront:
    """`stored`: the store's record of the turn `previous_response_id` names (None: not loaded yet)."""
    model = body.get("model")
    out = ResponsesFront(bounded_model(model))
    try:
        prev = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        if prev is not None:
            if not isinstance(prev, str) or not prev:
                raise InvalidRequest("'previous_response_id' must be a non-empty string.", param="previous_response_id")
            out.previous = prev
            if stored is None:
                out.need_history = True
                return out
            record = orjson.loads(stored)
            history, out.affinity = history_of(record), affinity_of(record)
        out.session = session_of(body.get("prompt_cache_key"))
        served = policy.names.served(model)
        if served in policy.native:
            if "input" not in body:
                raise InvalidRequest("'input' is required.", param="input")
            out.native, out.history = body, history
            return out
        req = parse_request(body, history, policy.auto_truncate_tokens,
                            pool_kinds=policy.kinds.get(served, frozenset()) if served is not None else frozenset(),
                            dropped=out.dropped, hosted_tools=policy.hosted_tools,
                            client_metadata=policy.client_metadata)
    except GatewayError as e:
        out.error = e
        return out
    # what only the store reads goes back only for a turn that is stored (input_items is as long as the history)
    out.req, out.history = (req, history) if req.store else (replace(req, input_items=[]), [])
    out.front = prepare(req.chat, "chat/completions", policy.hashing)
    return out
