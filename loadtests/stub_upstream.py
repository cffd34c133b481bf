"""An OpenAI-compatible upstream that answers instantly, for measuring proxy overhead only (peers.md's method).

Raw ASGI, no framework: non-streaming chat returns a canned completion; streaming chat sends `max_tokens` one-token
chunks as fast as the connection takes them (or one every `--chunk-interval-ms`, for streams that last like a model's),
then the usage chunk and [DONE]. `/health` answers 200. A body past 1 MiB is not parsed (answered as non-streamed):
a large prompt must not stall the stub's own loop and the streams it serves.

    .venv/bin/python -m loadtests.stub_upstream --port 18400 [--replicas 2] [--chunk-interval-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import orjson

from gateway.servers import make_server, serve_all

COMPLETION = orjson.dumps({
    "id": "stub", "object": "chat.completion", "created": 1767225600, "model": "zai-org/GLM-5.2",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a short answer from the stub"},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 60, "completion_tokens": 16, "total_tokens": 76, "prompt_tokens_details": {"cached_tokens": 0}},
})
CHUNK = b'data: {"id":"stub","object":"chat.completion.chunk","created":1767225600,"model":"zai-org/GLM-5.2","choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}]}\n\n'
ROLE = b'data: {"id":"stub","object":"chat.completion.chunk","created":1767225600,"model":"zai-org/GLM-5.2","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TAIL = (b'data: {"id":"stub","object":"chat.completion.chunk","created":1767225600,"model":"zai-org/GLM-5.2","choices":[],'
        b'"usage":{"prompt_tokens":60,"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n')
JSON = [(b"content-type", b"application/json")]
LARGE = 1 << 20
INTERVAL_S = 0.0


async def lifespan(receive: Any, send: Any) -> None:
    """Answer the ASGI lifespan messages until shutdown (the stubs hold nothing to start or stop)."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return


async def read_body(receive: Any) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    body = await read_body(receive)
    if scope["method"] == "GET":
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": b'{"object":"list","data":[]}'})
        return
    req = orjson.loads(body or b"{}") if len(body) < LARGE else {}
    if not req.get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": COMPLETION})
        return
    n = int(req.get("max_tokens") or 16)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": ROLE, "more_body": True})
    for _ in range(n):
        if INTERVAL_S:
            await asyncio.sleep(INTERVAL_S)
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": TAIL % (n, n + 60)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--chunk-interval-ms", type=float, default=0.0)
    a = p.parse_args()
    global INTERVAL_S
    INTERVAL_S = a.chunk_interval_ms / 1000
    asyncio.run(serve_all([make_server(app, "127.0.0.1", a.port + i) for i in range(a.replicas)]))


if __name__ == "__main__":
    main()
