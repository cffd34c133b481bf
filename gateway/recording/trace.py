"""The trace format, read and written: Mooncake's JSONL (FAST'25 trace release), which the gateway's own recordings
also use, so `aiperf --custom-dataset-type mooncake_trace` and `gateway replay` read both.

One JSON object per line:
    {"timestamp": <ms from the start>, "input_length": <tokens>, "output_length": <tokens>, "hash_ids": [<int>...]}
`hash_ids` are prefix-block ids at 512 tokens per block: an id identifies its block together with everything before
it, so two requests share KV for as many leading ids as they have in common; `len(hash_ids) == ceil(input_length /
512)` (the last block may be partial). Recordings may add `tenant` (a remapped int) and `cached_tokens` (what the
engine reported); readers ignore keys they do not know. Errors name the file and the line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BLOCK_TOKENS = 512


class TraceError(ValueError):
    """The trace cannot be used; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: int = 0
    cached_tokens: int | None = None  # recordings: the engine's reported hit

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"timestamp": round(self.timestamp_ms, 3), "input_length": self.input_length,
                             "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.tenant:
            d["tenant"] = self.tenant
        if self.cached_tokens is not None:
            d["cached_tokens"] = self.cached_tokens
        return d


def _int(obj: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise TraceError(f"{where}: '{key}' must be an integer >= {minimum}, got {v!r}")
    return int(v)


def parse_line(line: str, where: str) -> TraceRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0 or not math.isfinite(ts):
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    n_in = _int(obj, "input_length", where, 1)
    n_out = _int(obj, "output_length", where, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    if len(ids) != math.ceil(n_in / BLOCK_TOKENS):
        raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {n_in}: expected "
                         f"ceil({n_in} / {BLOCK_TOKENS}) = {math.ceil(n_in / BLOCK_TOKENS)}")
    tenant = _int(obj, "tenant", where) if "tenant" in obj else 0
    cached = _int(obj, "cached_tokens", where) if obj.get("cached_tokens") is not None else None
    return TraceRecord(float(ts), n_in, n_out, tuple(ids), tenant, cached)


def iter_trace(path: str | Path) -> Iterator[TraceRecord]:
    p = Path(path)
    try:
        f = p.open()
    except OSError as e:
        raise TraceError(f"{p}: cannot open: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield parse_line(line, f"{p}:{n}")


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The trace in arrival order (a recording is written as requests finish), the first `limit` arrivals."""
    out = sorted(iter_trace(path), key=lambda r: r.timestamp_ms)
    if not out:
        raise TraceError(f"{path}: no requests")
    return out[:limit] if limit is not None else out


def write_trace(records: Iterable[TraceRecord], out: TextIO) -> int:
    n = 0
    for r in records:
        out.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
        n += 1
    return n
