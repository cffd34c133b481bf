"""Everything the routing pipeline knows about one request, gathered once before it runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


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


# The agent session a request belongs to, named by the client (Claude Code's x-claude-code-session-id, Codex's
# prompt_cache_key / session_id), reaches routing as the request's `group_key`: a session's first turns and its
# subagents, whose prompts differ, land on one replica before any prefix of theirs is cached; a cached prefix (the
# prefix index) still decides first. Bounded before it is hashed.
MAX_SESSION_CHARS = 256


def session_group(tenant: str, session: str) -> int:
    """The cold-placement key of a tenant's session: the same in every process and instance (not hash())."""
    digest = hashlib.blake2b(f"{tenant}\x00{session[:MAX_SESSION_CHARS]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # non-negative, like the chunk hashes it stands in for
