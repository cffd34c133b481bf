"""A lean closed-loop HTTP/1.1 client for saturation runs: one kept-alive connection per concurrent caller, the request
bytes built once, the response read by Content-Length (or chunked). httpx spends more CPU per request than the gateway does, so
on a 2-core machine it, not the target, set the ceiling of `overhead.py`'s max req/s; this one costs a few tens of
microseconds per request. Non-streamed responses only (the overhead benchmark's)."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit


def request_bytes(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    u = urlsplit(url)
    head = [f"POST {u.path} HTTP/1.1", f"host: {u.netloc}", f"content-length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_body(reader: asyncio.StreamReader, head: bytes) -> None:
    """Read (and drop) a response body: by Content-Length, or chunked."""
    length, chunked = 0, False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line[15:])
        elif line.startswith(b"transfer-encoding:") and b"chunked" in line:
            chunked = True
    if not chunked:
        await reader.readexactly(length)
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        await reader.readexactly(size + 2)  # the chunk and its CRLF
        if size == 0:
            return


async def _caller(url: str, raw: bytes, stop: float, lat: list[float]) -> int:
    """Requests in a loop on one connection until `stop`; returns the errors (non-200, or a broken connection, after
    which it reconnects)."""
    u = urlsplit(url)
    errors = 0
    while time.perf_counter() < stop:
        try:
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
        except OSError:
            errors += 1
            await asyncio.sleep(0.01)
            continue
        try:
            while time.perf_counter() < stop:
                s = time.perf_counter()
                writer.write(raw)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                await read_body(reader, head)
                if status == 200:
                    lat.append(time.perf_counter() - s)
                else:
                    errors += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            errors += 1
        finally:
            writer.close()
    return errors


async def closed_loop(urls: list[str], body: bytes, headers: dict[str, str], concurrency: int,
                      seconds: float, path: str = "/v1/chat/completions") -> tuple[list[float], int]:
    """`concurrency` callers for `seconds`, spread over `urls`, POSTing `body` to `path`: (latencies of the 200s,
    errors)."""
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    raws = [request_bytes(u + path, body, headers) for u in urls]
    errs = await asyncio.gather(*(_caller(urls[i % len(urls)] + path, raws[i % len(urls)], stop, lat)
                                  for i in range(concurrency)))
    return lat, sum(errs)
