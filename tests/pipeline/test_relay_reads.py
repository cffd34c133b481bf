"""The streamed relay takes an upstream's events a network read at a time, pushed from the HTTP client's read
callback (`backends/push.py`, `pipeline/relay_stream.py`) or, for a backend without that, awaited by the response's
task (`HttpBackend._reads`): a read of one event (an engine decoding) has a short path, a read of several (or of
pieces of events) the general one. What the client receives must not depend on how the upstream's bytes were cut
into reads, nor on which of the two paths relayed them: the same events sent in one write, one write per event, in
7-byte pieces or CRLF-framed give the same body, byte for byte — with the model name rewritten or not, with usage
shown or hidden, and with an in-band error mid-stream. A client that reads slowly (its socket pushes back, the
upstream is paused meanwhile) gets the same body; a client that leaves ends the upstream request; an upstream that
goes silent ends the stream with an error event after what it sent.

A raw ASGI upstream (an SGLang pool, so the lean HTTP/1.1 client) sends a scripted stream; writes are spaced by a
pause so that they arrive as separate reads (when they do not, the body must still be the same)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.backends import openai_compat
from gateway.backends.push import UpstreamPush
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, wait_until

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
        self.gap = 0.005  # between writes
        self.hang = False  # after the writes, send nothing more (and never end the response) until the gateway leaves
        self.gone = 0  # requests whose connection the gateway closed before their end

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
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            for w in self.writes:
                if watch.done():
                    return
                await send({"type": "http.response.body", "body": w, "more_body": True})
                await asyncio.sleep(self.gap)  # a separate read for the gateway, as an engine's decode steps are
            if self.hang:
                await watch
                return
            await send({"type": "http.response.body", "body": b""})
        finally:
            watch.cancel()

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone += 1


Stack = tuple[ScriptedUpstream, str, Any]  # the upstream, the gateway's URL, the gateway


@pytest.fixture(scope="module")
def stack():
    up = ScriptedUpstream()
    server = ServerThread([up]).start()
    cfg = config([sglang_pool("p", server.urls, model=UPSTREAM_MODEL)],
                 models=[{"name": "glm-5.2", "pools": ["p"]}, {"name": UPSTREAM_MODEL, "pools": ["p"]}])
    cfg["timeouts"]["idle"] = IDLE
    gw = start_gateway(cfg)
    yield up, gw.urls[0], gw
    gw.stop()
    server.stop()


IDLE = 2.0  # the gateway's upstream idle timeout: far above the scripted gaps


@pytest.fixture(params=["pushed", "awaited"])
def path(request, monkeypatch):
    """Which path relays the stream: pushed from the read callback (an H1 upstream's), or awaited a read at a time
    (a backend without push: the H1 stream offered without it)."""
    if request.param == "awaited":
        monkeypatch.setattr(openai_compat, "UpstreamPush", lambda *a: None)
    return request.param


def _body(stack: Stack, events: list[bytes], mode: str, model: str, usage: bool) -> bytes:
    up, base, _ = stack
    up.writes = _writes(events, mode)
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY_A}"},
                   timeout=30, trust_env=False)
    assert r.status_code == 200, r.text
    return r.content


def _awaited(stack: Stack, events: list[bytes], model: str, usage: bool) -> bytes:
    mp = pytest.MonkeyPatch()
    mp.setattr(openai_compat, "UpstreamPush", lambda *a: None)
    try:
        return _body(stack, events, "one write", model, usage)
    finally:
        mp.undo()


@pytest.mark.parametrize("model", ["glm-5.2", UPSTREAM_MODEL])
@pytest.mark.parametrize("usage", [True, False])
def test_the_body_does_not_depend_on_how_the_upstream_cut_its_reads(stack, path, model, usage):
    bodies = {mode: _body(stack, EVENTS, mode, model, usage) for mode in MODES}
    one = bodies["one write"]
    for mode, b in bodies.items():
        assert b == one, f"{mode!r} differs from one write"
    assert one == _awaited(stack, EVENTS, model, usage)  # and from the path without push
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


def test_an_error_event_mid_stream_ends_it_the_same_way_whatever_the_reads(stack, path):
    bodies = {mode: _body(stack, ERROR, mode, "glm-5.2", True) for mode in MODES}
    one = bodies["one write"]
    for mode, b in bodies.items():
        assert b == one, f"{mode!r} differs from one write"
    assert one == _awaited(stack, ERROR, "glm-5.2", True)
    events = [e for e in one.split(b"\n\n") if e]
    assert b"[DONE]" not in one and b" three" not in one  # nothing after the error is relayed
    last = orjson.loads(events[-1][6:])
    assert last["error"]["code"] == "server_is_overloaded"
    assert [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]] == ["", "one", " two"]


def _dechunked(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked response's bytes (after its head)."""
    out, pos = [], 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[eol + 2:eol + 2 + size])
        pos = eol + 2 + size + 2


def _open_raw(base: str, body: dict[str, Any], rcvbuf: int | None = None) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    raw = orjson.dumps(body)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"authorization: Bearer {KEY_A}\r\nconnection: close\r\ncontent-length: {len(raw)}\r\n\r\n".encode()
              + raw)
    return s


def _send_buffer_max() -> int:
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return max(int(f.read().split()[2]), 1 << 20)
    except (OSError, IndexError, ValueError):
        return 4 << 20


def test_a_client_that_reads_slowly_gets_the_same_body(stack, monkeypatch):
    """A client whose socket pushes back (it reads nothing for longer than the upstream idle timeout, then
    everything): the relay pauses the upstream until the client drains, then goes on; the body is the one a fast
    reader gets, and the upstream's connection serves the next request."""
    up, base, _ = stack
    big = "x" * 16_000
    n = 3 * _send_buffer_max() // len(big)  # past what the gateway's socket buffers before it pushes back
    events = [EVENTS[0]] + [_event(_chunk({"content": f"{i}:{big}"})) for i in range(n)] + EVENTS[5:]
    fast = _body(stack, events, "a write per event", "glm-5.2", True)
    pauses = []
    pause = UpstreamPush.pause

    def counted(self: UpstreamPush) -> None:
        pauses.append(1)
        pause(self)

    monkeypatch.setattr(UpstreamPush, "pause", counted)
    up.writes, up.gap = _writes(events, "a write per event"), 0.0
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    s = _open_raw(base, body, rcvbuf=4096)
    try:
        wait_until(lambda: pauses, timeout=30, what="the client's socket pushing back (the upstream paused)")
        time.sleep(IDLE * 1.5)  # the client's time, not the upstream's silence: no idle timeout for it
        s.settimeout(30)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
        up.gap = 0.005
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert _dechunked(rest) == fast
    assert fast.endswith(b"data: [DONE]\n\n") and fast.count(big.encode()) == n
    # the upstream's connection, if it went back to the pool (its end came while the client pushed back), is read
    # again: the next request on it is answered (tests/backends/test_push.py has the case made certain)
    assert _body(stack, EVENTS, "one write", "glm-5.2", True).endswith(b"data: [DONE]\n\n")


def test_a_client_that_leaves_mid_stream_ends_the_upstream_request(stack, path):
    """The client reads the start of a long stream and closes its socket: the gateway closes the upstream's
    connection (the engine aborts the request) and the stream is no longer live."""
    up, base, _ = stack
    up.writes = _writes([EVENTS[0]] + [_event(_chunk({"content": f" {i}"})) for i in range(4000)], "a write per event")
    gone = up.gone
    s = _open_raw(base, {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    try:
        s.settimeout(30)
        got = b""
        while got.count(b"\n\n") < 3:  # three events (the head ends in CRLFs)
            chunk = s.recv(4096)
            assert chunk, f"the gateway closed the stream after {got[:600]!r}"
            got += chunk
    finally:
        s.close()
    wait_until(lambda: up.gone > gone, timeout=30, what="the upstream request ended by the gateway")
    wait_until(lambda: len(_live(stack)) == 0, timeout=10, what="no stream live")


def _live(stack: Stack) -> Any:
    return stack[2].app.state.proxy.live


def test_an_upstream_that_goes_silent_ends_the_stream_with_an_error_event(stack, path):
    """Three events, then nothing for the idle timeout: the client gets the three, then an error event naming the
    silence, no [DONE]; the upstream's connection is closed. The same whatever the reads."""
    up, _, _ = stack
    up.hang = True
    try:
        gone = up.gone
        bodies = {mode: _body(stack, EVENTS[:3], mode, "glm-5.2", True) for mode in ("one write", "a write per event")}
        wait_until(lambda: up.gone >= gone + 2, timeout=30, what="the silent upstream's connections closed")
    finally:
        up.hang = False
    one = bodies["one write"]
    assert bodies["a write per event"] == one
    events = [e for e in one.split(b"\n\n") if e]
    assert [orjson.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]] == ["", "one", " two"]
    last = orjson.loads(events[-1][6:])
    assert "no chunk from upstream" in last["error"]["message"] and b"[DONE]" not in one
