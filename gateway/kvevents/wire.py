"""SGLang's KV-event wire format, both encodings (shared/reference/real-sglang.md B.1 f).

A message is three frames `[topic, seq (8 bytes big-endian), payload]`; the payload is a msgpack array
`[ts, events, attn_dp_rank?]`. Events are tagged arrays up to 0.5.13 (`["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium?]`) and tagged maps from 0.5.23 (`{"type": "BlockStored", ...}`). Both are accepted;
unknown keys, trailing elements and unknown event types are ignored (a newer engine must not blind the consumer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

END_SEQ = -1  # the replay socket's end marker (as a signed 8-byte sequence)


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[int]
    parent: int | None
    tokens: list[int]
    block_size: int
    salt: str | None = None  # 0.5.23's cache_salt (the engine's namespace); None up to 0.5.13
    lora: str | None = None  # 0.5.23's lora_name (a LoRA request's adapter); lora_id is always null


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


class WireError(ValueError):
    """A payload that is not an event batch at all (counted, the batch skipped)."""


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event]
    rank: int | None
    maps: bool  # the 0.5.23 encoding was seen (tagged maps)


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("not an event batch [ts, events, rank]")
    ts = float(raw[0]) if isinstance(raw[0], (int, float)) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events: list[Event] = []
    maps = False
    for item in raw[1]:
        if isinstance(item, dict):
            maps = True
            ev = _from_map(item)
        elif isinstance(item, list) and item:
            ev = _from_array(item)
        else:
            ev = None
        if ev is not None:
            events.append(ev)
    return Batch(ts, events, rank, maps)


def _ints(v: Any) -> list[int]:
    return [x for x in v if isinstance(x, int)] if isinstance(v, list) else []


def _tokens(v: Any) -> list[int]:
    """Token ids unchecked here (10k+ per event): a non-uint32 element fails the page hashing, which counts the
    event as malformed (kvevents/blocks.py)."""
    return v if isinstance(v, list) else []


def _from_map(d: dict[str, Any]) -> Event | None:
    kind = d.get("type")
    if kind == "BlockStored":
        salt, lora = d.get("cache_salt"), d.get("lora_name")
        parent = d.get("parent_block_hash")
        return Stored(_ints(d.get("block_hashes")), parent if isinstance(parent, int) else None,
                      _tokens(d.get("token_ids")), int(d.get("block_size") or 0), salt if isinstance(salt, str) else None,
                      lora if isinstance(lora, str) else None)
    if kind == "BlockRemoved":
        return Removed(_ints(d.get("block_hashes")))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _from_array(a: list[Any]) -> Event | None:
    kind = a[0]
    if kind == "BlockStored" and len(a) >= 5:
        parent = a[2]
        return Stored(_ints(a[1]), parent if isinstance(parent, int) else None, _tokens(a[3]),
                      int(a[4]) if isinstance(a[4], int) else 0)
    if kind == "BlockRemoved" and len(a) >= 2:
        return Removed(_ints(a[1]))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
