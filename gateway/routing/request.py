"""Everything the routing pipeline knows about one request, gathered once before it runs."""

from __future__ import annotations

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
