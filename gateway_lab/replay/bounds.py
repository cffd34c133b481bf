"""What a trace allows, independent of any router (token-weighted, full blocks only, as the trace README defines):

- ideal: every block seen before is a hit (an infinite cache shared by the whole fleet);
- LRU bound: one LRU cache over the blocks with the fleet's total KV capacity; a full block seen before and still
  resident is a hit. A request touches its blocks deepest first, so like the engine's radix cache a prefix's leaves
  are evicted before its root.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.recording.trace import BLOCK_TOKENS, TraceRecord


def _keys(r: TraceRecord) -> Sequence[int]:
    return r.hash_ids  # ids already tell isolated cache namespaces apart (recordings hash them salted)


def ideal_hit_rate(trace: Sequence[TraceRecord]) -> float:
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        keys = _keys(r)
        full = r.input_length // BLOCK_TOKENS
        hit += sum(BLOCK_TOKENS for k in keys[:full] if k in seen)
        total += r.input_length
        seen.update(keys)
    return hit / total if total else 0.0


def lru_hits(trace: Sequence[TraceRecord], capacity_tokens: int) -> list[int]:
    """Each request's hit tokens under the LRU bound (below), in trace order."""
    cap = max(1, capacity_tokens // BLOCK_TOKENS)
    lru: OrderedDict[int, None] = OrderedDict()
    hits: list[int] = []
    for r in trace:
        keys = _keys(r)
        full = r.input_length // BLOCK_TOKENS
        hits.append(sum(BLOCK_TOKENS for k in keys[:full] if k in lru))
        for k in reversed(keys):
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > cap:
            lru.popitem(last=False)
    return hits


def lru_hit_rate(trace: Sequence[TraceRecord], capacity_tokens: int) -> float:
    total = sum(r.input_length for r in trace)
    return sum(lru_hits(trace, capacity_tokens)) / total if total else 0.0
