"""Request-side prefix hashes for `routing.mode` precise and hybrid: the request's token ids (a RequestTokenizer)
cut into engine pages, chained with the gateway's own key (kvevents/keys.py), and every `chunk_tokens /
block_size`-th key kept, so the routing engine still counts in chunks. Same signature as
gateway/prefix/hashing.prefix_hashes (the approximate mode's text-chunk hashes)."""

from __future__ import annotations

import time
from typing import Any

from gateway.kvevents import keys
from gateway.prefix.hashing import MAX_CHUNKS
from gateway.tokenizers import RequestTokenizer


class TokenPrefixHasher:
    def __init__(self, tokenizer: RequestTokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.cpu_s = 0.0  # tokenizer + hashing time, summed (the overhead table's figure)
        self.calls = 0

    def __call__(self, endpoint: str, body: dict[str, Any], model: str, namespace: str = "",
                 chunk_tokens: int = 256, max_chunks: int = MAX_CHUNKS) -> list[int]:
        t0 = time.perf_counter()
        every = max(1, chunk_tokens // self.block_size)
        ids = self.tokenizer.encode_request(endpoint, body)
        ids = ids[: max_chunks * chunk_tokens]
        out = keys.sampled(keys.chain(keys.seed(namespace), ids, self.block_size), every, max_chunks)
        self.cpu_s += time.perf_counter() - t0
        self.calls += 1
        return out
