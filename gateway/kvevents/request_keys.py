"""Request-side prefix hashes for `routing.mode` precise and hybrid: the request's token ids (a RequestTokenizer)
cut into engine pages, chained with the gateway's own key (kvevents/keys.py), and every `chunk_tokens /
block_size`-th key kept, so the routing engine still counts in chunks. Same signature as
gateway/prefix/hashing.prefix_hashes (the approximate mode's text-chunk hashes).

The chain is seeded with the engine's namespace as 0.5.23's events name it: the tenant's cache namespace (sent as
`cache_salt`) and the request's LoRA adapter (`lora_path`, SGLang's per-request adapter name). Engines up to 0.5.13
publish neither, so their events are keyed with no namespace; once such an engine is seen (`plain_needed`), a
namespaced request also gets its plain chain, kept in `plain_of` (namespaced key -> plain key, the last
`PLAIN_KEEP` keys) for the precise index to look those ranks up with.

A conversation's next turn repeats the previous turn's ids: the chain of its longest common prefix with one of the
namespace's last MEMO_PER_NAMESPACE requests is reused and only the pages after it are hashed (a key depends only
on the seed and the ids before it, so the keys are those a whole chain gives). The memo holds at most MEMO_TOKENS
ids over every namespace, least recently used namespace out first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.kvevents import keys
from gateway.kvevents.blocks import ADOPT_MIN_TOKENS
from gateway.prefix.hashing import MAX_CHUNKS
from gateway.tokenizers import RequestTokenizer

PLAIN_KEEP = 1 << 16  # ~1,600 requests of 40 chunks: far more than are between hashing and matching at once
MEMO_PER_NAMESPACE = 4  # a tenant's conversations in progress whose chains are kept
MEMO_TOKENS = 1 << 21  # ids kept over every namespace (8 MiB)


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
        # namespace -> its last requests' (ids, every page key), most recent first
        self._memo: OrderedDict[str, list[tuple[np.ndarray, list[int]]]] = OrderedDict()
        self._memo_tokens = 0
        self._lock = threading.Lock()  # large bodies are hashed on the offload pool's threads

    def __call__(self, endpoint: str, body: dict[str, Any], model: str, namespace: str = "",
                 chunk_tokens: int = 256, max_chunks: int = MAX_CHUNKS) -> list[int]:
        t0 = time.perf_counter()
        every = max(1, chunk_tokens // self.block_size)
        ids = self.tokenizer.encode_request(endpoint, body, namespace)
        ids = ids[: max_chunks * chunk_tokens]
        ns = keys.namespace(namespace, lora_of(body))
        ids = np.asarray(ids[: keys.MAX_PAGES * self.block_size], dtype=np.uint32)
        out = keys.sampled(self._chain(ns, ids), every, max_chunks)
        if self.plain_needed and ns:
            plain = keys.sampled(self._chain("", ids), every, max_chunks)
            table = self.plain_of
            for k, pk in zip(out, plain, strict=True):
                table[k] = pk
                table.move_to_end(k)
            while len(table) > PLAIN_KEEP:
                table.popitem(last=False)
        self.cpu_s += time.perf_counter() - t0
        self.calls += 1
        return out

    def keys_before(self, ns: str, run: Sequence[int], block_size: int) -> list[int] | None:
        """The keys in namespace `ns` of the pages before `run` in a recent request (the memo) that holds `run` from
        a page boundary past its first page (to its end, where the run goes on with generated tokens): where an
        engine's BlockStored under a parent this gateway never saw belongs (kvevents/blocks.py). The requests of
        `ns` are searched, or for events with no namespace (<= 0.5.13, every tenant's pages in one tree) those of
        every namespace. None when no request holds it, or two place it after different tokens."""
        if block_size != self.block_size or not len(run):
            return None
        with self._lock:
            past = [e for k in ([ns] if ns else list(self._memo)) for e in self._memo.get(k, ())]
        r = np.asarray(run, dtype=np.uint32)
        found: np.ndarray | None = None
        for ids, _ in past:
            for s in np.flatnonzero(ids == r[0]).tolist():
                m = min(len(r), len(ids) - s)
                if s % block_size or s == 0 or m < min(len(r), ADOPT_MIN_TOKENS) \
                        or not np.array_equal(ids[s:s + m], r[:m]):
                    continue
                if found is not None and not np.array_equal(found, ids[:s]):
                    return None
                found = ids[:s]
        return keys.chain(keys.seed(ns), found, block_size) if found is not None else None

    def _chain(self, ns: str, ids: np.ndarray) -> list[int]:
        """Every page key of `ids` in namespace `ns`, reusing the longest chain the memo shares a prefix with."""
        bs = self.block_size
        with self._lock:
            past = list(self._memo.get(ns, ()))
        reused: list[int] = []
        for past_ids, past_keys in past:
            n = min(len(past_ids), len(ids))
            diff = np.flatnonzero(past_ids[:n] != ids[:n])
            pages = min((int(diff[0]) if len(diff) else n) // bs, len(past_keys))
            if pages > len(reused):
                reused = past_keys[:pages]
        start = keys.to_digest(reused[-1]) if reused else keys.seed(ns)
        chained = reused + keys.chain(start, ids[len(reused) * bs:], bs)
        with self._lock:
            mine = self._memo.pop(ns, [])
            mine.insert(0, (ids, chained))
            self._memo_tokens += len(ids)
            for old_ids, _ in mine[MEMO_PER_NAMESPACE:]:
                self._memo_tokens -= len(old_ids)
            self._memo[ns] = mine[:MEMO_PER_NAMESPACE]
            while self._memo_tokens > MEMO_TOKENS and self._memo:
                _, dropped = self._memo.popitem(last=False)
                self._memo_tokens -= sum(len(i) for i, _ in dropped)
        return chained
