"""What a connection may hold before anything authenticates it (gateway/servers.py, config `http`): a request head
past its size or field-count limit gets a 431 and the connection closed, with nothing buffered; a head that does not
arrive in time gets a 408 (an idle connection a plain close); more connections from one address than allowed get a
429. Each refusal is in the OpenAI shape and counted. Real gateway on loopback, raw sockets as clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import orjson
import pytest

from gateway.app import create_admin_app, create_app
from gateway.config import HttpLimits, parse_config
from gateway.servers import make_server
from tests.gateway_fixtures import config, sglang_pool
from tests.support import ServerThread, wait_until

LIMITS = HttpLimits(max_header_bytes=16 * 1024, max_headers=40, header_read_s=1.0, max_connections_per_ip=20)


@pytest.fixture(scope="module")
def gw(sims):
    st_sims, _ = sims
    app = create_app(parse_config(config([sglang_pool("p", st_sims.urls)])))
    admin = create_admin_app(app)
    st = ServerThread([app, admin])  # the client listener under test, and the admin one for /metrics
    st.servers = [make_server(a, "127.0.0.1", p, timeout_keep_alive=5, openai_errors=True, http_limits=LIMITS)
                  for a, p in zip((app, admin), st.ports)]
    st.app, st.admin_url = app, st.urls[1]
    st.start()
    yield st
    st.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (a reset after its answer counts as the close)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def answer(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, orjson.loads(body)


def refusals(gw: ServerThread, reason: str) -> float:
    text = httpx.get(gw.admin_url + "/metrics").text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("gateway_requests_total{") and f'reason="{reason}"' in ln)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def send_in_background(s: socket.socket, data: bytes) -> threading.Thread:
    def run() -> None:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server closed after answering: the rest was never going to be read

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_32_mb_header_gets_431_closed_and_nothing_buffered(gw):
    """A 400 MB header used to raise an instance's RSS by 400 MB and be answered 200."""
    huge = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (32 * 1024 * 1024) + b"\r\n\r\n"
    before_count = refusals(gw, "headers_too_large")
    before = rss_kib()
    with connect(gw.ports[0]) as s:
        sender = send_in_background(s, huge)
        raw = read_all(s)
        sender.join(15)
    grew_mib = (rss_kib() - before) / 1024
    status, headers, body = answer(raw)
    print(f"32 MiB header: {status}, RSS grew {grew_mib:.1f} MiB")
    assert status == 431 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_header_fields_too_large" and "16384-byte" in body["error"]["message"]
    assert grew_mib < 8  # nothing of the 32 MiB kept (httptools alone buffers the whole header)
    wait_until(lambda: refusals(gw, "headers_too_large") == before_count + 1, what="the refusal counted")


def test_too_many_header_fields_get_431(gw):
    lines = b"".join(b"x-h%d: v\r\n" % i for i in range(LIMITS.max_headers + 1))
    with connect(gw.ports[0]) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + lines + b"\r\n")
        status, _, body = answer(read_all(s))
    assert status == 431 and "40 header fields" in body["error"]["message"]


def test_heads_within_the_limits_are_served_on_a_kept_alive_connection(gw):
    """Just under both limits is served; and a kept-alive connection idle for longer than header_read_s between
    requests is not a slow head (the keep-alive timeout governs idle connections)."""
    lines = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(LIMITS.max_headers - 2))
    with connect(gw.ports[0]) as s:
        for _ in range(2):
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + lines + b"\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                data += s.recv(65536)
            assert data.startswith(b"HTTP/1.1 200")
            time.sleep(LIMITS.header_read_s * 1.5)  # idle between requests, longer than the head timeout


def test_a_head_trickling_in_is_cut_with_408_and_an_idle_connection_is_closed(gw):
    """Slowloris: a header line now and then keeps no connection open past header_read_s."""
    before = refusals(gw, "header_timeout")
    with connect(gw.ports[0]) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        got = b""
        for i in range(200):  # up to 20 s of trickling: the server must end it long before
            try:
                s.sendall(b"x-slow-%d: 1\r\n" % i)
            except OSError:
                break
            s.settimeout(0.1)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            got += chunk
            if not chunk or b"}" in got:
                break
        s.settimeout(15)
        got += read_all(s)
    status, headers, body = answer(got)
    assert status == 408 and headers["connection"] == "close" and body["error"]["code"] == "request_timeout"
    wait_until(lambda: refusals(gw, "header_timeout") == before + 1, what="the refusal counted")
    with connect(gw.ports[0]) as idle:  # never sends a byte: closed without an answer
        assert read_all(idle) == b""


def test_connections_per_address_are_capped(gw):
    held = [connect(gw.ports[0]) for _ in range(LIMITS.max_connections_per_ip)]
    try:
        wait_until(lambda: len(gw.servers[0].server_state.connections) >= LIMITS.max_connections_per_ip,
                   what="the held connections accepted")
        with connect(gw.ports[0]) as extra:
            status, _, body = answer(read_all(extra))
        assert status == 429 and body["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    wait_until(lambda: httpx.get(gw.urls[0] + "/healthz").status_code == 200, what="served again once they closed")


def test_defaults_follow_common_proxies():
    d = HttpLimits()
    assert (d.max_header_bytes, d.max_headers, d.header_read_s, d.max_connections_per_ip) == (65536, 100, 20.0, None)


async def _slow_second(scope, receive, send):
    """An ASGI app: /slow answers after 2 s, anything else at once."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2.0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_request_on_a_kept_alive_connection_outlives_the_keep_alive_timeout():
    """The keep-alive timeout closes a connection idle since its last response, never one whose next request is in
    progress: a stream on a reused connection (an agent's next turn) was cut this long after the turn before's end,
    and a request it had already billed was lost to its client."""
    st = ServerThread([_slow_second])
    st.servers = [make_server(_slow_second, "127.0.0.1", st.ports[0], timeout_keep_alive=1, openai_errors=True,
                              http_limits=LIMITS)]
    st.start()
    try:
        with connect(st.ports[0]) as s:
            for path in (b"/fast", b"/slow"):  # the second outlasts the keep-alive timer armed by the first's end
                s.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                data = b""
                while not data.endswith(b"\r\n\r\nok"):
                    chunk = s.recv(65536)
                    assert chunk, f"closed before {path.decode()}'s answer: {data!r}"
                    data += chunk
                assert data.startswith(b"HTTP/1.1 200")
    finally:
        st.stop()
