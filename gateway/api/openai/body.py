"""Reading a request body at the edge: bounded in size and in time."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from gateway.errors import RequestTimeout, RequestTooLarge

DEFAULT_READ_TIMEOUT_S = 5.0


async def read_body(request: Request, limit: int, timeout: float = DEFAULT_READ_TIMEOUT_S) -> bytes:
    """The whole body, or a 413 past `limit` bytes, or a 408 when it has not all arrived within `timeout` seconds
    (a client declaring a Content-Length larger than what it sends would otherwise hold the connection)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
                chunks.append(chunk)
    except TimeoutError:
        err = RequestTimeout(f"The request body did not arrive within {timeout:g} s ({size} bytes received"
                             + (f" of {declared} declared)." if declared else ")."), should_retry=False)
        err.extra_headers["connection"] = "close"  # the rest of the body may still come: never read it as a request
        raise err from None
    return b"".join(chunks)
