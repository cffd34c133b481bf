"""Everything the routing pipeline knows about one request, gathered once before it runs."""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    tenant: str
    model: str  # client-facing name
    endpoint: str  # chat/completions | completions
    stream: bool
    prompt_tokens: int  # estimated with the shared tokenizer rule
    max_output_tokens: int | None
    hashes: tuple[int, ...] = ()  # prefix chunk hashes (salted with the tenant's cache namespace)
    ttft_sla_s: float = 2.22
    objective: str = "cost"  # cost | latency
    on_sla_miss: str = "spill"  # spill | shed
    group_key: int = 0  # cold placement key: a chunk hash deep enough to identify the shared prefix
    # A stored conversation's replica (a Responses previous_response_id chain): the target that served the last
    # turn, and that turn's prompt tokens, which it holds in its cache whatever the prefix index says now
    affinity_hint: str | None = None
    affinity_tokens: int = 0


# Set by the Responses routes around the chat path's call, for that request's task only: (target name, prompt
# tokens of the stored turn). The chat path builds its RoutingRequest without knowing the API it serves.
AFFINITY: ContextVar[tuple[str, int] | None] = ContextVar("gateway_affinity", default=None)


def with_affinity(req: RoutingRequest) -> RoutingRequest:
    """`req` with the hint of the request being served (AFFINITY), unless it carries one already."""
    hint = AFFINITY.get()
    if hint is None or req.affinity_hint is not None:
        return req
    return replace(req, affinity_hint=hint[0], affinity_tokens=max(int(hint[1]), 0))


# The agent session a request belongs to, named by the client (Claude Code's x-claude-code-session-id, Codex's
# prompt_cache_key / session_id): set by the Messages and Responses bridges around the chat path's call, for that
# request only. It becomes the cold-placement key, so a session's first turns and its subagents, whose prompts differ,
# land on one replica before any prefix of theirs is cached; a cached prefix (the prefix index) still decides first.
SESSION: ContextVar[str | None] = ContextVar("gateway_session", default=None)
MAX_SESSION_CHARS = 256


def session_group(tenant: str, session: str) -> int:
    """The cold-placement key of a tenant's session: the same in every process and instance (not hash())."""
    digest = hashlib.blake2b(f"{tenant}\x00{session[:MAX_SESSION_CHARS]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # non-negative, like the chunk hashes it stands in for
