"""A framing-aware SSE reader: events may be split across (or packed into) network reads."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield the `data:` payload of each event (joined if an event has several data lines); comments skipped."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            frame, buf = buf[:end], buf[end + 2 :]
            payload = _data(frame)
            if payload is not None:
                yield payload
    if buf.strip():
        payload = _data(buf)
        if payload is not None:
            yield payload


def _data(frame: bytes) -> bytes | None:
    if frame.startswith(b"data: ") and b"\n" not in frame:
        return frame[6:]  # the common case: one data line
    parts = []
    for line in frame.split(b"\n"):
        if line.startswith(b"data:"):
            parts.append(line[5:].lstrip(b" ") if line[5:6] == b" " else line[5:])
    return b"\n".join(parts) if parts else None
