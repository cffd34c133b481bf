"""The GETs of the background polls (engine loads and facts, health probes) over the lean HTTP/1.1 client.

Idle, a gateway's CPU was mostly these polls (~10 GETs a second for 8 servers), and most of that was httpx's
machinery (docs/results/2026-11-28-idle-cpu.md). `PollClient.get` answers as `httpx.AsyncClient.get` does for what the
polls use (`status_code`, `json()`, `text`) and fails with httpx's errors, so the callers' failure handling is the one
they had: a refused connection is `httpx.ConnectError`, a deadline `httpx.ConnectTimeout` / `httpx.ReadTimeout`, a
body over `max_body` or a broken answer `httpx.ReadError` / `httpx.RemoteProtocolError`. Unlike httpx's per-phase
timeouts, `timeout` bounds the whole answer. One keep-alive pool per plain-HTTP origin (the poller's 1 s loads read
keeps the connection the 5 s health probe reuses); any other URL (TLS: hosted pools) goes through the httpx client.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from gateway.backends.h1 import H1ConnectError, H1Dropped, H1Error, H1Pool, H1Timeout, H1TooLarge

MAX_BODY = 8 << 20  # bytes: /v1/loads and /server_info are a few KiB, a vLLM /metrics some hundreds


class PollResponse:
    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        return orjson.loads(self.content)  # orjson.JSONDecodeError is a ValueError, as httpx's json() raises

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class PollClient:
    def __init__(self, fallback: httpx.AsyncClient, max_body: int = MAX_BODY) -> None:
        self.fallback = fallback
        self.max_body = max_body
        self._pools: dict[str, H1Pool | None] = {}  # origin -> its pool (None: not plain HTTP, httpx's)

    def _pool(self, origin: str) -> H1Pool | None:
        try:
            return self._pools[origin]
        except KeyError:
            pass
        u = httpx.URL(origin)
        pool = H1Pool(u.host, u.port or 80, max_idle=4) if u.scheme == "http" and u.host and not u.userinfo else None
        self._pools[origin] = pool
        return pool

    async def get(self, url: str, *, headers: dict[str, str], timeout: float) -> PollResponse | httpx.Response:
        cut = url.find("/", 8) if url.startswith("http://") else -1
        pool = self._pool(url[:cut]) if cut > 0 else None
        if pool is None:
            return await self.fallback.get(url, headers=headers, timeout=timeout)
        try:
            status, body = await pool.get(url[cut:], headers, timeout, self.max_body)
        except H1ConnectError as e:
            raise httpx.ConnectError(str(e)) from None
        except H1Timeout as e:
            raise (httpx.ConnectTimeout if e.connecting else httpx.ReadTimeout)(str(e)) from None
        except (H1TooLarge, H1Dropped) as e:
            raise httpx.ReadError(str(e)) from None
        except H1Error as e:
            raise httpx.RemoteProtocolError(str(e)) from None
        return PollResponse(status, body)

    def close(self) -> None:
        for pool in self._pools.values():
            if pool is not None:
                pool.close()
        self._pools.clear()
