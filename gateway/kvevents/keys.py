"""The gateway's own block keys: a chain hash over each page's token ids, the same on the event side (from the
BlockStored token ids) and on the request side (from the request's token ids), in every gateway instance.

    K_0 = seed(namespace), K_i = blake2b(K_{i-1} || tokens of page i as uint32 little-endian, 8 bytes)

The engine's own hashes are never reproduced (they change with the release and the salt rule); they only link
removals and parents to these keys. A request is matched on every `chunk_tokens / block_size`-th key (a chain key
identifies its whole prefix, and the engine evicts leaves first), so the routing engine's chunk unit is unchanged.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import numpy as np

MAX_PAGES = 1 << 18  # bounds request-side work (262k pages)


def namespace(salt: str | None, lora: str | None = None) -> str:
    """The engine's KV namespace as the events name it: 0.5.23 puts `cache_salt` and, for a LoRA request, the
    adapter's `lora_name` on every BlockStored (its radix tree never shares pages across either). Up to 0.5.13
    neither is on the wire (`lora_id` is always null), so those events key with no namespace at all."""
    if not lora:
        return salt or ""
    return f"{salt or ''}\x00lora:{lora}"


def seed(namespace: str | None) -> bytes:
    return hashlib.blake2b(b"gw-kv\x00" + (namespace or "").encode(), digest_size=8).digest()


def orphan_seed(engine_parent: int) -> bytes:
    """A block whose parent the consumer never saw starts a chain of its own: it is indexed (so its removal and
    its children resolve) but can never match a request's chain from the root. The engine hash is taken modulo
    2^64: SGLang's are signed and vLLM's unsigned 64-bit, and either must seed, never raise."""
    raw = (engine_parent & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    return hashlib.blake2b(b"gw-kv-orphan\x00" + raw, digest_size=8).digest()


def chain(prev: bytes, tokens: np.ndarray | Sequence[int], block_size: int) -> list[int]:
    """Keys of the full pages of `tokens`, chained on `prev` (a trailing partial page has none)."""
    n = min(len(tokens) // block_size, MAX_PAGES)
    raw = _u32le(tokens[: n * block_size])
    step = block_size * 4
    out = []
    h = prev
    b2 = hashlib.blake2b
    for i in range(n):
        h = b2(h + raw[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(h, "big", signed=True))
    return out


def _u32le(tokens: np.ndarray | Sequence[int]) -> bytes:
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<u4", copy=False).tobytes()
    a = array.array("I", tokens)  # 3x faster than numpy from a list (the event path: msgpack gives lists)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def to_digest(key: int) -> bytes:
    return key.to_bytes(8, "big", signed=True)


def sampled(keys: Sequence[int], every: int, limit: int) -> list[int]:
    """Every `every`-th key (the key closing each routing chunk), at most `limit`."""
    return list(keys[every - 1 :: every][:limit])
