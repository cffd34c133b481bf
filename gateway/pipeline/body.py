"""Reading a request body at the edge: bounded in size and in time."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from gateway.errors import RequestTimeout, RequestTooLarge

DEFAULT_READ_TIMEOUT_S = 5.0
TOTAL_FACTOR = 12  # however steadily it trickles, a body gets at most this many read timeouts in all (60 s default)
CONFIRM_PASSES = 3  # callback passes a passed deadline waits for bytes already taken from the socket


async def read_body(request: Request, limit: int, timeout: float = DEFAULT_READ_TIMEOUT_S) -> bytes:
    """The whole body, or a 413 past `limit` bytes, or a 408 when no byte arrived for `timeout` seconds (a client
    declaring a Content-Length larger than what it sends would otherwise hold the connection) or the whole body
    took more than TOTAL_FACTOR x `timeout`. Like nginx's client_body_timeout, the bound is on the gap between reads,
    so a large body on a slow but live link still arrives. ClientDisconnect when the client left mid-body. The
    request's stream is consumed: read the body once, here."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
    if hasattr(request, "_body"):  # already read (a framework dependency did): Starlette keeps it
        body = await request.body()
        if len(body) > limit:
            raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
        return body
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    start = last = loop.time()
    hard = start + timeout * TOTAL_FACTOR
    fired = False
    cancelling = task.cancelling()
    handle: asyncio.Handle

    # One timer for the whole read, re-armed only when it fires early: asyncio.timeout would cancel and re-create
    # a timer handle per chunk (~0.03 ms CPU a request, most bodies being one chunk).
    def check() -> None:
        nonlocal handle
        due = min(last + timeout, hard)
        if loop.time() < due:
            handle = loop.call_at(due, check)
            return
        # The deadline passed, but by the clock of a loop that may itself have been blocked (a long synchronous step
        # elsewhere): bytes that arrived meanwhile are taken from the socket around this iteration and reach this read
        # one or two callback passes later (asyncio polls the socket before its timers, uvloop after). Decide then, on
        # what really arrived: no 408 for a body that was there all along.
        handle = loop.call_soon(confirm, size, CONFIRM_PASSES)

    def confirm(seen: int, passes: int) -> None:
        nonlocal handle, fired
        if size != seen:  # bytes arrived after all: keep reading (past the whole-body bound only while they flow)
            check()
        elif passes > 1:
            handle = loop.call_soon(confirm, seen, passes - 1)
        else:
            fired = True
            task.cancel()

    handle = loop.call_at(min(start + timeout, hard), check)
    receive = request.receive  # the ASGI messages themselves: Request.stream()'s async generator costs more
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge(f"The request body is larger than the {limit}-byte limit.")
                chunks.append(chunk)
                last = loop.time()
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if fired and task.uncancel() <= cancelling:  # our cancel, not the caller's: the body stopped arriving
            err = RequestTimeout(f"The request body stopped arriving: nothing for {timeout:g} s, or over "
                                 f"{timeout * TOTAL_FACTOR:g} s in all ({size} bytes received"
                                 + (f" of {declared} declared)." if declared else ")."), should_retry=False)
            err.extra_headers["connection"] = "close"  # the rest of the body may still come: never read it as a request
            raise err from None
        raise
    finally:
        handle.cancel()
    return b"".join(chunks)
