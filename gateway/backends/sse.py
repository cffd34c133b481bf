"""A framing-aware, strict SSE reader: events may be split across (or packed into) network reads.

Strict, because what an upstream streams is relayed to clients whose SDKs parse each event as JSON: a frame that is
not an OpenAI-style event — a line that is no SSE field, an event without `data:`, a payload that is neither a JSON
object nor `[DONE]` — raises `MalformedEvent` instead of being skipped or passed on (the relay then ends the stream
with an error event, never as a success). Comment lines (`: keep-alive`) are allowed anywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

FIELDS = (b"data", b"event", b"id", b"retry")


class MalformedEvent(Exception):
    """The upstream sent something that is not a well-formed event (the message says what, never its bytes)."""


async def sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield the `data:` payload of each event (joined if an event has several data lines); comments skipped.

    A read's events are sliced from it by position (cutting the rest of the buffer after each event copied it once
    per event: quadratic in the events one read carries), and the common frame — one `data:` line — is taken
    here without the general parser's calls."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        pos = 0
        while True:
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            frame, pos = buf[pos:end], end + 2
            if frame[:6] == b"data: " and b"\n" not in frame:
                yield _checked(frame[6:])
                continue
            payload = _data(frame)
            if payload is not None:
                yield payload
        if pos:
            buf = buf[pos:]
    if buf.strip():
        payload = _data(buf.strip(b"\n"))
        if payload is not None:
            yield payload


def _data(frame: bytes) -> bytes | None:
    """The frame's payload; None for a frame of comments only (or an empty one)."""
    if frame.startswith(b"data: ") and b"\n" not in frame:
        return _checked(frame[6:])  # the common case: one data line
    parts = []
    other = False
    for line in frame.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if name not in FIELDS:
            raise MalformedEvent("a line that is not an SSE field")
        if name == b"data":
            parts.append(value[1:] if value[:1] == b" " else value)
        else:
            other = True
    if not parts:
        if other:
            raise MalformedEvent("an event without data")
        return None
    return _checked(b"\n".join(parts))


def _checked(payload: bytes) -> bytes:
    p = payload.strip()
    if p == b"[DONE]" or (p[:1] == b"{" and p[-1:] == b"}"):
        return payload
    raise MalformedEvent("a payload that is neither a JSON object nor the end marker")
