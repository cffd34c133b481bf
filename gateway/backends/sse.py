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
    """Yield the `data:` payload of each event (joined if an event has several data lines); comments skipped."""
    split = SseSplitter()
    async for chunk in chunks:
        for payload in split.feed(chunk):
            yield payload
    for payload in split.end():
        yield payload


class SseSplitter:
    """The payloads of a stream's events, a network read at a time: `feed(read)` returns the payloads of the events
    the read completed (several, one or none: an event may span reads), `end()` those of what was left at the end.

    A read's events are sliced from it by position (cutting the rest of the buffer after each event copied it once
    per event: quadratic in the events one read carries), and the common frame — one `data:` line holding a JSON
    object — is taken here without the general parser's calls."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self.buf and chunk[:7] == b"data: {" and chunk[-3:] == b"}\n\n" and chunk.find(b"\n") == len(chunk) - 2:
            return [chunk[6:-2]]  # a read of one event, one line (an engine's decode step): nothing to search
        buf = self.buf + chunk if self.buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        pos = 0
        while True:
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            frame, pos = buf[pos:end], end + 2
            if frame[:6] == b"data: " and b"\n" not in frame:
                payload = frame[6:]
                if not (payload[:1] == b"{" and payload[-1:] == b"}"):
                    payload = _checked(payload)
                out.append(payload)
                continue
            other = _data(frame)
            if other is not None:
                out.append(other)
        self.buf = buf[pos:] if pos else buf
        return out

    def end(self) -> list[bytes]:
        rest, self.buf = self.buf, b""
        if not rest.strip():
            return []
        payload = _data(rest.strip(b"\n"))
        return [payload] if payload is not None else []


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
