"""The floor under the gateway's CPU per request: the same server stack with (almost) nothing on top.

Two plain ASGI apps served exactly as `gateway serve` serves the gateway (uvicorn's httptools protocol with the
gateway's limits and OpenAI-shaped parser errors, on uvloop: `gateway.servers.make_server` + `run_loop`):
- `answer`: a canned chat completion, the body read and dropped — what uvicorn alone costs per request;
- `relay`: the body passed to the upstream through the gateway's own HTTP/1.1 client (`backends/h1.py`) and the
  answer passed back byte for byte, streams by network read — what a proxy with no pipeline (no auth, validation,
  routing, accounting) costs on this stack.
`loadtests/overhead.py --floors` runs both next to the gateway, interleaved with it.

    .venv/bin/python -m loadtests.floor_server --mode relay --port 18530 --upstream http://127.0.0.1:18400
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson

from gateway.backends.h1 import H1Pool
from gateway.servers import make_server, run_loop, serve_all
from loadtests.stub_upstream import lifespan, read_body

COMPLETION = orjson.dumps({
    "id": "floor", "object": "chat.completion", "created": 1767225600, "model": "glm-5.2",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a short answer from the floor"},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 60, "completion_tokens": 16, "total_tokens": 76},
})


def make_app(mode: str, upstreams: list[str]) -> Any:
    pools = [H1Pool(u.split("//")[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in upstreams]
    turn = [0]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["path"] in ("/healthz", "/health"):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = await read_body(receive)
        if mode == "answer":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": COMPLETION})
            return
        pool = pools[turn[0] % len(pools)]
        turn[0] += 1
        resp, _ = await pool.request(scope["path"], body, {"content-type": "application/json"}, 10.0)
        ctype = resp.headers.get(b"content-type", b"application/json")
        await send({"type": "http.response.start", "status": resp.status_code, "headers": [(b"content-type", ctype)]})
        async for chunk in resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        await resp.aclose()

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("answer", "relay"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", action="append", default=[], help="relay: an upstream base URL (repeat: taken in turn)")
    a = p.parse_args()
    run_loop(serve_all([make_server(make_app(a.mode, a.upstream), "127.0.0.1", a.port, openai_errors=True)]))


if __name__ == "__main__":
    main()
