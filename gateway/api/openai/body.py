"""Reading a request body at the edge: bounded in size and in time."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from gateway.errors import RequestTimeout, RequestTooLarge

DEFAULT_READ_TIMEOUT_S = 5.0
TOTAL_FACTOR = 12  # however steadily it trickles, a body gets at most this many read timeouts in all (60 s default)


async def read_body(request: Request, limit: int, timeout: float = DEFAULT_READ_TIMEOUT_S) -> bytes:
    """The whole body, or a 413 past `limit` bytes, or a 408 when no byte arrived for `timeout` seconds (a client
    declaring a Content-Length larger than what it sends would otherwise hold the connection) or the whole body
    took more than TOTAL_FACTOR x `timeout`. Like nginx's client_body_timeout, the bound is on the gap between reads,
    so a large body on a slow but live link still arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    hard = loop.time() + timeout * TOTAL_FACTOR
    try:
        async with asyncio.timeout_at(min(loop.time() + timeout, hard)) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
                chunks.append(chunk)
                deadline.reschedule(min(loop.time() + timeout, hard))
    except TimeoutError:
        err = RequestTimeout(f"The request body stopped arriving: nothing for {timeout:g} s, or over "
                             f"{timeout * TOTAL_FACTOR:g} s in all ({size} bytes received"
                             + (f" of {declared} declared)." if declared else ")."), should_retry=False)
        err.extra_headers["connection"] = "close"  # the rest of the body may still come: never read it as a request
        raise err from None
    return b"".join(chunks)
