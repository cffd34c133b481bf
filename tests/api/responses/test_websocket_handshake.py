"""Codex CLI opens the Responses API as a WebSocket first. On the listener `gateway serve` runs, the handshake is
answered by the API as the HTTP request it also is: the key first (401, final), then 426 for a good key — which the
client takes as "HTTP here" and falls back to POST /v1/responses at once, instead of retrying the handshake five
times with backoff (tests/e2e/agents/test_codex.py runs the real client) — and 405 for a plain GET."""

from __future__ import annotations

import base64
import os
import socket

import orjson
import pytest

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims


@pytest.fixture(scope="module")
def gw():
    sims, _ = start_sims(1)
    g = start_gateway(config([sglang_pool("p", sims.urls)]), served=True)
    yield g
    g.stop()
    sims.stop()


def _get(port: int, key: str, upgrade: bool) -> tuple[int, dict[str, str], dict]:
    head = [b"GET /v1/responses HTTP/1.1", b"host: x", b"authorization: Bearer " + key.encode()]
    if upgrade:
        head += [b"connection: Upgrade", b"upgrade: websocket", b"sec-websocket-version: 13",
                 b"sec-websocket-key: " + base64.b64encode(os.urandom(16))]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        head_part, _, rest = got.partition(b"\r\n\r\n")
        lines = head_part.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            rest += s.recv(65536)
    return int(lines[0].split()[1]), headers, orjson.loads(rest)


def test_a_websocket_handshake_with_a_good_key_is_told_to_use_http(gw):
    status, headers, body = _get(gw.ports[0], KEY_A, upgrade=True)
    assert status == 426 and body["error"]["code"] == "websocket_not_supported"
    assert "POST /v1/responses" in body["error"]["message"] and headers["x-should-retry"] == "false"


def test_a_websocket_handshake_with_a_bad_key_is_a_401(gw):
    status, headers, body = _get(gw.ports[0], "sk-wrong", upgrade=True)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["x-should-retry"] == "false"


def test_a_plain_get_is_a_405_in_the_openai_shape(gw):
    status, _, body = _get(gw.ports[0], KEY_A, upgrade=False)
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
