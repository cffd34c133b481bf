"""The streamed relay takes an upstream's events a network read at a time (`HttpBackend._reads`, `Relay.stream_rest`):
a read of one event (an engine decoding) has a short path, a read of several (or of pieces of events) the general
one. What the client receives must not depend on how the upstream's bytes were cut into reads: the same events sent
in one write, one write per event, in 7-byte pieces or CRLF-framed give the same body, byte for byte — with the model
name rewritten or not, with usage shown or hidden, and with an in-band error mid-stream.

A raw ASGI upstream (an SGLang pool, so the lean HTTP/1.1 client) sends a scripted stream; writes are spaced by a
pause so that they arrive as separate reads (when they do not, the body must still be the same)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread

UPSTREAM_MODEL = "zai-org/GLM-5.2"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": UPSTREAM_MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **extra}


EVENTS = [
    _event(_chunk({"role": "assistant", "content": ""})),
    _event(_chunk({"content": "one"})),
    # the model name again inside the event (an engine's extra field): only the first is the event's own
    _event(_chunk({"content": " two"}, meta={"model": UPSTREAM_MODEL})),
    b'data:{"id":"c1","object":"chat.completion.chunk","created":1,"model": "' + UPSTREAM_MODEL.encode()
    + b'","choices":[{"index":0,"delta":{"content":" three"},"finish_reason":"length"}]}\n\n',  # "data:", "model": "
    b": keep-alive\n\n",
    _event({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": UPSTREAM_MODEL, "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}),
    b"data: [DONE]\n\n",
]
ERROR = [*EVENTS[:3], _event({"error": {"message": "engine overloaded", "code": 503}}), *EVENTS[3:]]


def _writes(events: list[bytes], mode: str) -> list[bytes]:
    """The stream's bytes cut into the upstream's writes."""
    raw = b"".join(events)
    if mode == "one write":
        return [raw]
    if mode == "a write per event":
        return list(events)
    if mode == "7-byte pieces":
        return [raw[i:i + 7] for i in range(0, len(raw), 7)]
    assert mode == "crlf, a write per event"
    return [e.replace(b"\n", b"\r\n") for e in events]


MODES = ["one write", "a write per event", "7-byte pieces", "crlf, a write per event"]


class ScriptedUpstream:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET":  # health and the engine's polls
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for w in self.writes:
            await send({"type": "http.response.body", "body": w, "more_body": True})
            await asyncio.sleep(0.005)  # a separate read for the gateway, as an engine's decode steps are
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def stack():
    up = ScriptedUpstream()
    server = ServerThread([up]).start()
    cfg = config([sglang_pool("p", server.urls, model=UPSTREAM_MODEL)],
                 models=[{"name": "glm-5.2", "pools": ["p"]}, {"name": UPSTREAM_MODEL, "pools": ["p"]}])
    gw = start_gateway(cfg)
    yield up, gw.urls[0]
    gw.stop()
    server.stop()


def _body(stack: tuple[ScriptedUpstream, str], events: list[bytes], mode: str, model: str, usage: bool) -> bytes:
    up, base = stack
    up.writes = _writes(events, mode)
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY_A}"},
                   timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("model", ["glm-5.2", UPSTREAM_MODEL])
@pytest.mark.parametrize("usage", [True, False])
def test_the_body_does_not_depend_on_how_the_upstream_cut_its_reads(stack, model, usage):
    bodies = {mode: _body(stack, EVENTS, mode, model, usage) for mode in MODES}
    one = bodies["one write"]
    for mode, b in bodies.items():
        assert b == one, f"{mode!r} differs from one write"
    events = [e for e in one.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [orjson.loads(e[6:]) for e in events[:-1]]
    assert [o["model"] for o in objs] == [model] * len(objs)  # every event's own model name is the client's
    assert objs[2]["meta"] == {"model": UPSTREAM_MODEL}  # the second occurrence is left as it came
    assert "".join(o["choices"][0]["delta"]["content"] for o in objs if o["choices"]) == "one two three"
    if usage:
        assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3
        assert "cost_usd" in objs[-1]["usage"]
    else:
        assert all(o["choices"] for o in objs)


def test_an_error_event_mid_stream_ends_it_the_same_way_whatever_the_reads(stack):
    bodies = {mode: _body(stack, ERROR, mode, "glm-5.2", True) for mode in MODES}
    one = bodies["one write"]
    for mode, b in bodies.items():
        assert b == one, f"{mode!r} differs from one write"
    events = [e for e in one.split(b"\n\n") if e]
    assert b"[DONE]" not in one and b" three" not in one  # nothing after the error is relayed
    last = orjson.loads(events[-1][6:])
    assert last["error"]["code"] == "server_is_overloaded"
    assert [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]] == ["", "one", " two"]
