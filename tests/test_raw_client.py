"""The saturation client of `loadtests/overhead.py --client raw` counts what it was answered: every 200 on its
kept-alive connections, and a non-200 as an error (a client that miscounted would report a ceiling that is not one)."""

from __future__ import annotations

import asyncio
from typing import Any

from loadtests import raw_client, stub_upstream
from tests.support import ServerThread


async def refusing(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """429 with a Content-Length body, for every request."""
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 429, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def test_raw_client_counts_answers_and_errors():
    st = ServerThread([stub_upstream.app, refusing]).start()
    try:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
        lat, errors = asyncio.run(raw_client.closed_loop(st.urls[:1], body, {"content-type": "application/json"}, 4, 0.5))
        assert len(lat) > 10 and errors == 0
        # answered, not 200 (and by Content-Length where the stub answers chunked): errors, never served
        lat, errors = asyncio.run(raw_client.closed_loop([st.urls[1]], body, {}, 2, 0.3))
        assert not lat and errors > 0
    finally:
        st.stop()
