"""What an API adapter hands the one request path besides the body it parsed: the API the client spoke and the
routing hints its protocol carries. The chat and completions routes pass none; the Responses and Messages adapters
name themselves and, where the client said so, the agent session and the replica that served the stored turn.

Explicit and typed, carried on the request's Exchange from the edge to accounting — never ambient state — so a
stream accounted after its route returned still knows what it was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# The endpoint's own API when an adapter does not name one (a metric label: observability.metrics.APIS).
ENDPOINT_APIS = {"chat/completions": "chat", "completions": "completions", "responses": "responses"}


class StreamEncoder(Protocol):
    """Writes one API's stream from the chat path's chunks, each handed over as the dict it was parsed into once
    (api/responses/stream.py, api/messages/stream.py). Each method returns the bytes to send (maybe none)."""

    def start(self) -> bytes: ...

    def chunk(self, chunk: dict[str, Any]) -> bytes: ...

    def error(self, error: dict[str, Any]) -> bytes: ...

    def done(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Call:
    # the API the client spoke (metrics' and the log line's `api`); None: the endpoint's own
    api: str | None = None
    # the agent session the client named (Claude Code's session id, Codex's prompt_cache_key / session_id): its
    # requests share one cold placement, so a session's first turns and its subagents land together
    session: str | None = None
    # (target name, prompt tokens) of the replica that served the stored turn this one continues (Responses
    # previous_response_id): a routing floor, since that replica holds the turn's prompt whatever the index says
    affinity: tuple[str, int] | None = None
    # a stream in another API's shape: the relay hands this encoder each upstream chunk as a dict (parsed once) and
    # sends what it writes; None: the chat path's own SSE, relayed as bytes
    encoder: StreamEncoder | None = None
    # the size of the client's body the adapter parsed (with the stored turn it continues): a large one's CPU steps
    # run off the event loop (offload.py)
    body_bytes: int = 0
    # the front half of the body the pipeline validates (front.py `Front`: validated, rendered, hashed ahead, in a
    # worker process for a large body); None: the pipeline runs those stages itself
    front: Any = None

    def api_for(self, endpoint: str) -> str:
        return self.api or ENDPOINT_APIS.get(endpoint, "other")


PLAIN = Call()
