"""Consistent hashing with bounded loads (arXiv 1608.01350), pure: every gateway instance that sees the same
replicas and loads places a cold prefix on the same replica without talking to the others; a replica already
above (1 + eps) x the mean load is skipped for the next one on the ring, so hot prefixes spread."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

VNODES = 64


def _h(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=256)
def _ring(names: tuple[str, ...]) -> tuple[list[int], list[str]]:
    points = sorted((_h(f"{n}#{v}"), n) for n in names for v in range(VNODES))
    return [p for p, _ in points], [n for _, n in points]


MIN_BOUND = 8  # below this many in-flight requests a replica is never "overloaded": tiny totals would scatter prefixes


def place(key: int, names: Sequence[str], loads: Mapping[str, float], factor: float = 1.25) -> list[str]:
    """Names in ring order from `key`, the first one under the load bound first (the others follow as fallbacks)."""
    if not names:
        return []
    uniq = tuple(sorted(set(names)))
    positions, owners = _ring(uniq)
    total = sum(loads.get(n, 0.0) for n in uniq)
    bound = max(MIN_BOUND, math.ceil(factor * (total + 1) / len(uniq)))
    start = bisect.bisect(positions, key & 0xFFFFFFFFFFFFFFFF)
    order: list[str] = []
    for i in range(len(owners)):
        n = owners[(start + i) % len(owners)]
        if n not in order:
            order.append(n)
        if len(order) == len(uniq):
            break
    under = [n for n in order if loads.get(n, 0.0) + 1 <= bound]
    return under + [n for n in order if n not in under]
