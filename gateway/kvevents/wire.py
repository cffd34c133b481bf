"""SGLang's KV-event wire format, both encodings (shared/reference/real-sglang.md B.1 f).

A message is three frames `[topic, seq (8 bytes big-endian), payload]`; the payload is a msgpack array
`[ts, events, attn_dp_rank?]`. Events are tagged arrays up to 0.5.13 (`["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium?]`) and tagged maps from 0.5.23 (`{"type": "BlockStored", ...}`). Both are accepted;
unknown keys, trailing elements and unknown event types are ignored (a newer engine must not blind the consumer).

vLLM (0.32) sends the same framing and maps, with three differences read here:
- its block hashes are unsigned 64-bit (SGLang's are signed), or raw bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0;
  both become Python ints, used only as map keys;
- it names no `cache_salt`: a request's salt is one of the first block's `extra_keys` (`extra_keys[0]`: the LoRA
  name first when `lora_name` is set, `(mm_id, offset)` pairs, then the salt string), present only on an event
  whose first block is the sequence's first (no parent), which is the only place a namespace seeds a chain;
- `block_size` on a partial prefix-cache block is that block's own length, not the page size (kvevents/blocks.py).
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


def _hash(x: Any) -> int | None:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, bytes):  # vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the digest itself
        return int.from_bytes(x[:8].rjust(8, b"\0"), "big") if x else None
    return None


def _ints(v: Any) -> list[int]:
    if not isinstance(v, list):
        return []
    return [h for h in map(_hash, v) if h is not None]


def _salt_of(d: dict[str, Any], lora: str | None) -> str | None:
    """SGLang's `cache_salt`, else vLLM's salt in `extra_keys[0]` (see the module docstring)."""
    salt = d.get("cache_salt")
    if isinstance(salt, str):
        return salt
    extra = d.get("extra_keys")
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], list | tuple):
        return None
    first = list(extra[0])
    if lora and first and first[0] == lora:
        first = first[1:]
    return next((k for k in first if isinstance(k, str) and k), None)


def _tokens(v: Any) -> list[int]:
    """Token ids unchecked here (10k+ per event): a non-uint32 element fails the page hashing, which counts the
    event as malformed (kvevents/blocks.py)."""
    return v if isinstance(v, list) else []


def _from_map(d: dict[str, Any]) -> Event | None:
    kind = d.get("type")
    if kind == "BlockStored":
        lora = d.get("lora_name") if isinstance(d.get("lora_name"), str) else None
        bs = d.get("block_size")
        return Stored(_ints(d.get("block_hashes")), _hash(d.get("parent_block_hash")), _tokens(d.get("token_ids")),
                      bs if isinstance(bs, int) else 0, _salt_of(d, lora), lora)
    if kind == "BlockRemoved":
        return Removed(_ints(d.get("block_hashes")))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _from_array(a: list[Any]) -> Event | None:
    kind = a[0]
    if kind == "BlockStored" and len(a) >= 5:
        return Stored(_ints(a[1]), _hash(a[2]), _tokens(a[3]),
                      int(a[4]) if isinstance(a[4], int) else 0)
    if kind == "BlockRemoved" and len(a) >= 2:
        return Removed(_ints(a[1]))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
