"""The prefix index seam: which replica holds how much of a request's prefix (as chains of chunk hashes).

Replica keys are `name@incarnation`, so a restarted replica (new incarnation) inherits nothing.
Entries expire: a speculative entry (written at dispatch) lives `speculative_ttl`; confirmed at the first token it
lives `ttl` (expected engine residency); when the engine's reported cached_tokens fall short of the prediction,
the entries beyond the real hit point are invalidated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PrefixIndex(Protocol):
    async def match(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Longest run of leading hashes each replica holds (only replicas with a match > 0)."""

    async def insert(self, replica: str, hashes: Sequence[int], ttl: float) -> None: ...

    async def invalidate(self, replica: str, hashes: Sequence[int]) -> None:
        """The replica does not hold these (the tail of a prefix beyond the engine's real hit)."""

    def insert_soon(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        """`insert` that no one waits for: in this instance's view at once, in the shared index with the other writes
        staged meanwhile (`gateway/write_behind.py`)."""

    def invalidate_soon(self, replica: str, hashes: Sequence[int]) -> None:
        """`invalidate` that no one waits for, as `insert_soon`."""

    async def settle(self) -> None:
        """Every write made so far has reached the shared index (shutdown, tests)."""

    async def drop_replica(self, replica: str) -> None: ...

    def set_capacity(self, replica: str, chunks: int) -> None:
        """Bound a replica's entries to what its KV cache holds (LRU trimming beyond)."""

    async def size(self) -> int: ...
