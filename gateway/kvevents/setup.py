"""Wiring for `routing.mode` precise | hybrid: the tokenizer, the request hasher, the subscriptions and the precise
index around the approximate one (app.py calls `build`; approximate mode builds none of it)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from gateway.config import Routing
from gateway.kvevents.index import PreciseIndex
from gateway.kvevents.manager import KvEventsManager
from gateway.kvevents.request_keys import TokenPrefixHasher
from gateway.prefix.index import PrefixIndex
from gateway.tokenizers import build_tokenizer
from gateway.upstreams import UpstreamRegistry


@dataclass
class Precise:
    manager: KvEventsManager
    index: PreciseIndex
    hasher: TokenPrefixHasher


def build(rc: Routing, registry: UpstreamRegistry, http: httpx.AsyncClient, inner: PrefixIndex,
          metrics: CollectorRegistry | None = None) -> Precise:
    tokenizer = build_tokenizer(rc.kv_events.tokenizer)
    manager = KvEventsManager(rc.kv_events, registry, http, tokenizer=tokenizer)
    hasher = TokenPrefixHasher(tokenizer, rc.kv_events.block_size)
    index = PreciseIndex(inner, rc.mode, manager.ranks_for, dispatch_ttl_s=rc.speculative_ttl_s,
                         lag_ttl_s=rc.kv_events.speculative_s, plain_of=hasher.plain_of)
    manager.index = index
    manager.hasher = hasher
    if metrics is not None:
        metrics.register(manager.collector())
    return Precise(manager, index, hasher)
