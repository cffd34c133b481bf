"""vLLM's KV events (0.32, read from its `vllm/distributed/kv_events.py` and `v1/core/block_pool.py`) through the
gateway's consumer: its salt in `extra_keys[0]`, unsigned 64-bit hashes, partial prefix-cache blocks, promotion
(BlockRemoved + BlockStored), cached blocks re-announced without a parent, and a subscription that no event can
end. The payloads are built as vLLM's msgspec structs encode them (tagged maps, defaults omitted)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from gateway.kvevents import keys
from gateway.kvevents.blocks import RankBlocks
from gateway.kvevents.subscriber import Subscription
from gateway.kvevents.wire import Stored, decode_batch

PAGE = 16
U64 = (1 << 64) - 1


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int = PAGE, extra: Any = None,
           lora: str | None = None) -> dict[str, Any]:
    """vLLM's BlockStored as msgspec writes it: `cache_salt` never named; the salt is in the first block's extra keys."""
    d: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                         "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                         "lora_name": lora}
    if extra is not None:
        d["extra_keys"] = extra
    return d


def batch(*events: dict[str, Any], rank: int | None = None) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events)] + ([rank] if rank is not None else []))


def request_keys(tokens: list[int], salt: str | None, lora: str | None = None) -> list[int]:
    return keys.chain(keys.seed(keys.namespace(salt, lora)), np.asarray(tokens), PAGE)


def test_salt_in_extra_keys_matches_the_salted_request() -> None:
    """A tenant's requests are salted; vLLM carries the salt as the first block's extra key, so the event's keys must
    equal the salted request's keys (before this, precise mode matched nothing of vLLM's events)."""
    tokens = list(range(500, 500 + 3 * PAGE))
    ev = stored([U64 - 1, U64 - 2, U64 - 3], None, tokens, extra=[["tenant-a"], None, None])
    b = decode_batch(batch(ev))
    assert b.events[0] == Stored([U64 - 1, U64 - 2, U64 - 3], None, tokens, PAGE, "tenant-a", None)
    blocks = RankBlocks(page=PAGE)
    blocks.apply(b.events)
    assert all(k in blocks.held for k in request_keys(tokens, "tenant-a"))
    assert not any(k in blocks.held for k in request_keys(tokens, None))


def test_salt_after_the_lora_name_and_multimodal_pairs() -> None:
    """extra_keys[0] lists the LoRA name first (when lora_name is set), then (mm_id, offset) pairs, then the salt."""
    tokens = list(range(2 * PAGE))
    ev = stored([7, 8], None, tokens, extra=[["adapter-1", ["img-hash", 0], "tenant-b"], None], lora="adapter-1")
    st = decode_batch(batch(ev)).events[0]
    assert isinstance(st, Stored) and st.salt == "tenant-b" and st.lora == "adapter-1"
    blocks = RankBlocks(page=PAGE)
    blocks.apply([st])
    assert all(k in blocks.held for k in request_keys(tokens, "tenant-b", "adapter-1"))


def test_unsalted_vllm_events_match_unsalted_requests() -> None:
    tokens = list(range(PAGE))
    blocks = RankBlocks(page=PAGE)
    blocks.apply(decode_batch(batch(stored([1], None, tokens))).events)
    assert request_keys(tokens, None)[0] in blocks.held


def test_unsigned_hashes_never_raise_even_as_unknown_parents() -> None:
    """vLLM's hashes are unsigned 64-bit: a parent >= 2^63 that the consumer never saw seeds an orphan chain (the
    signed conversion raised OverflowError there and ended the subscription)."""
    blocks = RankBlocks(page=PAGE)
    blocks.apply(decode_batch(batch(stored([U64, U64 - 5], U64 - 9, list(range(2 * PAGE))))).events)
    assert blocks.orphans == 1 and len(blocks) == 2
    assert keys.orphan_seed(U64) != keys.orphan_seed(0)
    assert keys.orphan_seed(-1) == keys.orphan_seed(U64)  # the same 64 bits, signed or not
    blocks.apply(decode_batch(batch({"type": "BlockRemoved", "block_hashes": [U64, U64 - 5], "medium": "GPU"})).events)
    assert len(blocks) == 0


def test_bytes_hashes_are_read_as_ints() -> None:
    """With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the hashes are the raw digests."""
    tokens = list(range(PAGE))
    st = decode_batch(batch(stored([b"\xff" * 32], None, tokens))).events[0]
    assert isinstance(st, Stored) and st.hashes == [U64]


def test_partial_block_then_promotion() -> None:
    """A partial prefix-cache block (block_size shorter than the page) is tracked by hash but never matched; its
    promotion to a full block arrives as BlockRemoved(partial) + BlockStored(full, under the previous block)."""
    tokens = list(range(1000, 1000 + 2 * PAGE))
    blocks = RankBlocks(page=PAGE)
    blocks.apply(decode_batch(batch(stored([11], None, tokens[:PAGE], extra=[["t"]]))).events)
    blocks.apply(decode_batch(batch(stored([12], 11, tokens[PAGE:PAGE + 8], block_size=8))).events)
    assert blocks.partials == 1 and len(blocks) == 1 and 12 in blocks.by_engine
    applied = blocks.apply(decode_batch(batch(
        {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
        stored([13], 11, tokens[PAGE:], extra=[None]))).events)
    assert not applied.removed  # the partial block had no key to take out of the index
    want = request_keys(tokens, "t")
    assert len(blocks) == 2 and all(k in blocks.held for k in want) and blocks.orphans == 0


def test_reannounced_cached_blocks_change_nothing() -> None:
    """On a prefix hit vLLM re-announces the cached blocks from the first, with no parent and the salt again."""
    tokens = list(range(3 * PAGE))
    blocks = RankBlocks(page=PAGE)
    first = stored([1, 2, 3], None, tokens, extra=[["s"], None, None])
    blocks.apply(decode_batch(batch(first)).events)
    held, by_engine = set(blocks.held), dict(blocks.by_engine)
    blocks.apply(decode_batch(batch(stored([1, 2], None, tokens[: 2 * PAGE], extra=[["s"], None]))).events)
    assert blocks.held == held and blocks.by_engine == by_engine and blocks.orphans == 0


def test_no_event_stops_a_subscription() -> None:
    """An application that raises is counted and logged; the next batches are still applied in sequence."""
    calls: list[int] = []

    def on_batch(b: Any) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise OverflowError("int too big to convert")

    sub = Subscription(None, "tcp://h:1", None, "", on_batch=on_batch, on_reset=lambda why: None)  # type: ignore[arg-type]
    sub._first_after_connect = False
    for seq in (0, 1, 2):
        sub._receive([b"", seq.to_bytes(8, "big"), batch(stored([U64], U64 - 1, list(range(PAGE))))])
    assert calls == [0, 1, 2] and sub.stats.apply_errors == 1 and sub.stats.last_seq == 2
    assert sub.health()["apply_errors"] == 1
