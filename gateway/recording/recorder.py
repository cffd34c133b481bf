"""Record live traffic as an anonymized trace in the replay format (`replay/trace.py`), so a user can replay their
own traffic against a changed fleet or policy with `gateway replay`.

What a line holds: arrival (ms since the recording started), input and output tokens (the engine's usage, else the
gateway's estimate), the engine's reported cached tokens, a tenant number and the prompt's 512-token block ids.
Never text, never a tenant name, never a hash that could be matched against another recording: block ids and tenant
numbers are remapped per recording (first seen = next integer), so equal ids mean equal prefixes within one file
and nothing outside it.

Block ids come from the router's prefix hashes (already salted per cache namespace): the chunk hash at a block's end
identifies everything before it, which is the Mooncake meaning of a block id. With `routing.chunk_tokens` dividing
512 that is exact; otherwise the last whole chunk inside the block stands for it. Blocks past the hashed ones (the
trailing partial block, or past the hash cap) get fresh ids.

Lines are written as requests finish, so arrivals are not in order; readers sort them (`read_trace`).
Bounded: the recorder stops (and says so once in the log) at `recording.max_requests` lines or
`recording.max_bytes`; the remap tables only hold ids of the lines written.

On and off: from the start when `recording.path` is set (unless `recording.autostart: false`), and by on-call through
the admin API (`POST /admin/recording/start|stop`). A start begins a new recording: the file is truncated and the
remap tables, counters and time origin reset, so one file is always one recording. The path only ever comes from
the config: the admin API cannot make the gateway write anywhere else.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gateway.config import Recording
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway.routing.request import RoutingRequest

log = logging.getLogger("gateway.recorder")


class TraceRecorder:
    def __init__(self, cfg: Recording, chunk_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.chunk_tokens = chunk_tokens
        self.clock = clock
        self.path = Path(cfg.path) if cfg.path else None
        self._f: IO[str] | None = None
        self._t0: float | None = None
        self._ids: dict[int, int] = {}
        self._tenants: dict[str, int] = {}
        self._next_id = 0
        self.requests = 0
        self.bytes = 0
        self.full = False
        self.active = self.path is not None and cfg.autostart
        self.started_at: float | None = time.time() if self.active else None

    @property
    def enabled(self) -> bool:
        return self.active and not self.full

    def start(self) -> None:
        """Begin a new recording at the configured path (truncated; fresh ids, counters and time origin)."""
        if self.path is None:
            raise ValueError("recording.path is not configured")
        self.close()
        self._t0 = None
        self._ids.clear()
        self._tenants.clear()
        self._next_id = self.requests = self.bytes = 0
        self.full = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")  # a started recording exists on disk even before its first request
        self.active = True
        self.started_at = time.time()

    def stop(self) -> None:
        """Stop recording; the file stays as written (line-buffered, so complete up to the last request)."""
        self.active = False
        self.close()

    def _open(self) -> IO[str]:
        if self._f is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # line-buffered: a record is on disk when its request is accounted (one small write per request),
            # so a recording is readable while the gateway runs and nothing waits on a clean shutdown
            self._f = self.path.open("w", buffering=1)
        return self._f

    def _fresh(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _block_ids(self, hashes: tuple[int, ...], input_length: int) -> tuple[int, ...]:
        n_blocks = math.ceil(input_length / BLOCK_TOKENS)
        ids = []
        for k in range(n_blocks):
            last = (BLOCK_TOKENS * (k + 1)) // self.chunk_tokens - 1  # the last whole chunk inside block k
            full = (k + 1) * BLOCK_TOKENS <= input_length
            if full and 0 <= last < len(hashes):
                h = hashes[last]
                if h not in self._ids:
                    self._ids[h] = self._fresh()
                ids.append(self._ids[h])
            else:
                ids.append(self._fresh())
        return tuple(ids)

    def record(self, rreq: RoutingRequest | None, usage: dict[str, Any] | None, arrived_at: float) -> None:
        """One finished request (called once, by the request path's accounting). `arrived_at`: the clock's time
        when the request arrived."""
        if not self.enabled or rreq is None:
            return
        if self._t0 is None:
            self._t0 = arrived_at
        u = usage or {}
        prompt = u.get("prompt_tokens")
        n_in = prompt if isinstance(prompt, int) and prompt > 0 else rreq.prompt_tokens
        if n_in <= 0:
            return
        out = u.get("completion_tokens")
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        tenant = self._tenants.setdefault(rreq.tenant, len(self._tenants) + 1)
        rec = TraceRecord(max(0.0, (arrived_at - self._t0) * 1000), n_in, out if isinstance(out, int) and out >= 0 else 0,
                          self._block_ids(tuple(rreq.hashes), n_in), tenant,
                          cached if isinstance(cached, int) and cached >= 0 else None)
        line = json.dumps(rec.to_json(), separators=(",", ":")) + "\n"
        if self.requests >= self.cfg.max_requests or self.bytes + len(line) > self.cfg.max_bytes:
            self.full = True
            log.warning("trace recording stopped at its bound: %d requests, %d bytes in %s", self.requests, self.bytes,
                        self.path)
            self.flush()
            return
        self._open().write(line)
        self.requests += 1
        self.bytes += len(line)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def status(self) -> dict[str, Any]:
        return {"path": str(self.path) if self.path else None, "recording": self.enabled, "requests": self.requests,
                "bytes": self.bytes, "full": self.full, "started_at": self.started_at,
                "max_requests": self.cfg.max_requests, "max_bytes": self.cfg.max_bytes}
