"""Request-side prefix hashes for `routing.mode` precise and hybrid: the request's token ids (a RequestTokenizer)
cut into engine pages, chained with the gateway's own key (kvevents/keys.py), and every `chunk_tokens /
block_size`-th key kept, so the routing engine still counts in chunks. Same signature as
gateway/prefix/hashing.prefix_hashes (the approximate mode's text-chunk hashes).

The chain is seeded with the engine's namespace as 0.5.23's events name it: the tenant's cache namespace (sent as
`cache_salt`) and the request's LoRA adapter (`lora_path`, SGLang's per-request adapter name). Engines up to 0.5.13
publish neither, so their events are keyed with no namespace; once such an engine is seen (`plain_needed`), a
namespaced request also gets its plain chain, kept in `plain_of` (namespaced key -> plain key, the last
`PLAIN_KEEP` keys) for the precise index to look those ranks up with.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from gateway.kvevents import keys
from gateway.prefix.hashing import MAX_CHUNKS
from gateway.tokenizers import RequestTokenizer

PLAIN_KEEP = 1 << 16  # ~1,600 requests of 40 chunks: far more than are between hashing and matching at once


def lora_of(body: dict[str, Any]) -> str | None:
    """The adapter SGLang will run the request with (`lora_path`: a loaded adapter's name; a batch's first)."""
    lp = body.get("lora_path")
    if isinstance(lp, list) and lp:
        lp = lp[0]
    return lp if isinstance(lp, str) and lp else None


class TokenPrefixHasher:
    def __init__(self, tokenizer: RequestTokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.cpu_s = 0.0  # tokenizer + hashing time, summed (the overhead table's figure)
        self.calls = 0
        self.plain_needed = False  # an engine publishes without namespaces (<= 0.5.13): set by the manager
        self.plain_of: OrderedDict[int, int] = OrderedDict()

    def __call__(self, endpoint: str, body: dict[str, Any], model: str, namespace: str = "",
                 chunk_tokens: int = 256, max_chunks: int = MAX_CHUNKS) -> list[int]:
        t0 = time.perf_counter()
        every = max(1, chunk_tokens // self.block_size)
        ids = self.tokenizer.encode_request(endpoint, body, namespace)
        ids = ids[: max_chunks * chunk_tokens]
        ns = keys.namespace(namespace, lora_of(body))
        out = keys.sampled(keys.chain(keys.seed(ns), ids, self.block_size), every, max_chunks)
        if self.plain_needed and ns:
            plain = keys.sampled(keys.chain(keys.seed(None), ids, self.block_size), every, max_chunks)
            table = self.plain_of
            for k, pk in zip(out, plain, strict=True):
                table[k] = pk
                table.move_to_end(k)
            while len(table) > PLAIN_KEEP:
                table.popitem(last=False)
        self.cpu_s += time.perf_counter() - t0
        self.calls += 1
        return out
