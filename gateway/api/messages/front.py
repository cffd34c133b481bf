"""The front half of a Messages request, one function of its parsed body and plain data (`messages_front`): the
translation to the chat form, `message_start`'s estimate, Claude Code's session id from `metadata.user_id`, then the
chat path's own front half (pipeline/front.py `prepare`: validated, rendered, hashed). The route runs it inline for
a small body and in a worker process for a large one (gateway/offload.py `CpuPool.front`), and gets back what it
and the chat path need: an error is returned, not raised, with the model it was refused for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.api.dropped import Dropped
from gateway.api.messages.translate import input_tokens, to_chat
from gateway.errors import GatewayError
from gateway.pipeline.front import Front, Hashing, Names, bounded_model, prepare
from gateway.pipeline.json_body import bulk_lists


@dataclass(frozen=True, slots=True)
class MessagesPolicy:
    """What the translation needs of the tenant and its routes, as plain data."""

    names: Names
    hosted_tools: str
    client_metadata: str
    vision: dict[str, bool]  # served model -> whether its route takes images (absent: yes)
    hashing: Hashing | None


@dataclass(slots=True)
class MessagesFront:
    model: str | None  # the body's `model` (bounded), for the log line of a refusal
    error: GatewayError | None = None
    chat: dict[str, Any] | None = None
    estimate: int = 0  # message_start's input tokens (streamed requests)
    session: str | None = None  # `metadata.user_id`'s session_id (Claude Code)
    dropped: Dropped = field(default_factory=Dropped)
    front: Front | None = None

    def bulk_lists(self) -> list[list[Any]]:
        return bulk_lists(self.chat) if self.chat is not None else []


def metadata_session(body: dict[str, Any]) -> object:
    """The `session_id` Claude Code puts in `metadata.user_id` (a JSON string), if any."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str) and meta["user_id"].startswith("{"):
        try:
            parsed = orjson.loads(meta["user_id"])
        except orjson.JSONDecodeError:
            return None
        return parsed.get("session_id") if isinstance(parsed, dict) else None
    return None


def messages_front(body: dict[str, Any], policy: MessagesPolicy) -> MessagesFront:
    model = body.get("model")
    out = MessagesFront(bounded_model(model))
    served = policy.names.served(model)
    try:
        chat = to_chat(body, dropped=out.dropped, hosted_tools=policy.hosted_tools,
                       client_metadata=policy.client_metadata,
                       images=policy.vision.get(served, True) if served is not None else True)
        out.estimate = input_tokens(chat) if chat["stream"] else 0
    except GatewayError as e:
        out.error = e
        return out
    out.chat = chat
    out.session = s if isinstance(s := metadata_session(body), str) else None
    out.front = prepare(chat, "chat/completions", policy.hashing)
    return out
