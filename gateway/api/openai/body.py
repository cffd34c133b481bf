"""Reading a request body at the edge: bounded in size (and, later, in time)."""

from __future__ import annotations

from starlette.requests import Request

from gateway.errors import RequestTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
        chunks.append(chunk)
    return b"".join(chunks)
