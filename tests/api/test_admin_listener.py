"""The admin listener: the admin API and /metrics answer on their own port only. The client port (what a client
Service publishes) serves the APIs and the probes, and answers 404 to every admin route and to /metrics — with a
valid admin token too — so nothing tenant-identifying (tenant names, spend) is public in the default config."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import httpx
import orjson
import pytest
import yaml

from gateway.config import hash_key
from tests.api.openai.test_edge import _admin_routes
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import env_without_proxies, free_port, start_sims, wait_http

ADMIN = "admin-listener-token"
SCRAPE = "scrape-token"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def sims():
    st, _ = start_sims(1)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def gw(sims):
    g = start_gateway(config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]}))
    yield g
    g.stop()


def _served(gw) -> None:
    r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, timeout=20,
                   json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_client_port_answers_404_to_every_admin_route_and_to_metrics(gw):
    """Every route the admin listener serves under /admin (enumerated from its app, not listed here) and /metrics
    are unknown on the client port, whatever the token; the APIs and the probes still answer there."""
    _served(gw)
    routes = _admin_routes(gw.app)
    assert routes == []  # the client app registers no admin route at all
    from gateway.app import create_admin_app

    admin_routes = _admin_routes(create_admin_app(gw.app))
    assert len(admin_routes) >= 15
    for method, template in admin_routes + [("GET", "/metrics")]:
        path = re.sub(r"\{[^}]+\}", "x", template)
        for headers in ({}, ADMIN_H):
            r = httpx.request(method, gw.urls[0] + path, headers=headers, timeout=10)
            assert r.status_code in (404, 405), (method, path, r.status_code)  # 405: a path the APIs also know
            assert "tenant-a" not in r.text
    assert httpx.get(gw.urls[0] + "/console").status_code == 404  # the console lives beside the admin API
    for probe in ("/healthz", "/health", "/readyz"):
        assert httpx.get(gw.urls[0] + probe).status_code == 200
    # the admin listener has them: the same instance (its metrics count the request served on the client port)
    text = httpx.get(gw.admin_url + "/metrics").text
    assert 'tenant="tenant-a"' in text
    assert httpx.get(gw.admin_url + "/admin/state", headers=ADMIN_H).status_code == 200
    assert httpx.get(gw.admin_url + "/healthz").status_code == 200
    assert httpx.get(gw.admin_url + "/console").status_code == 200
    # and it serves no API: a client key gets nothing there
    r = httpx.post(gw.admin_url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, json={})
    assert r.status_code == 404


def test_metrics_behind_a_scrape_token(sims):
    """`admin.metrics_token_hashes`: /metrics asks for a scrape token (or an admin token), 401 in the error shape
    without one and no metric in the body; the admin API keeps its own token."""
    g = start_gateway(config([sglang_pool("p", sims.urls)],
                             admin={"token_hashes": [hash_key(ADMIN)], "metrics_token_hashes": [hash_key(SCRAPE)]}))
    try:
        _served(g)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {KEY_A}"}):
            r = httpx.get(g.admin_url + "/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "gateway_requests_total" not in r.text
        for token in (SCRAPE, ADMIN):
            r = httpx.get(g.admin_url + "/metrics", headers={"authorization": f"Bearer {token}"})
            assert r.status_code == 200 and 'tenant="tenant-a"' in r.text
        assert httpx.get(g.admin_url + "/admin/state", headers={"authorization": f"Bearer {SCRAPE}"}).status_code == 401
    finally:
        g.stop()


def test_on_client_port_serves_both_on_the_client_port_when_asked(sims):
    """The single-port opt-in (`admin.on_client_port: true`): the admin API (still behind its token) and /metrics on
    the client port as well."""
    g = start_gateway(config([sglang_pool("p", sims.urls)],
                             admin={"token_hashes": [hash_key(ADMIN)], "on_client_port": True}))
    try:
        assert httpx.get(g.urls[0] + "/admin/state", headers=ADMIN_H).status_code == 200
        assert httpx.get(g.urls[0] + "/admin/state").status_code == 401
        assert httpx.get(g.urls[0] + "/metrics").status_code == 200
    finally:
        g.stop()


def _port_and_next_free() -> int:
    """A free loopback port whose next port is free too (the default admin port under test)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


def test_gateway_serve_starts_both_listeners_admin_on_the_api_port_plus_one(sims, tmp_path):
    """`gateway serve` with no admin.port: the admin listener on --port + 1, loopback; the client port has neither
    /metrics nor /admin."""
    port = _port_and_next_free()
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]})))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
                            env=env_without_proxies(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # both listeners start together, in no set order: wait for each before asking either
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
        wait_http(f"http://127.0.0.1:{port + 1}/healthz", proc=proc)
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/admin/state", headers=ADMIN_H).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port + 1}/metrics").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port + 1}/admin/state", headers=ADMIN_H).status_code == 200
    finally:
        proc.terminate()  # by our own PID
        _, err = proc.communicate(timeout=30)
    lines = [orjson.loads(ln) for ln in err.splitlines() if ln.strip()]  # the log stream: JSON lines only
    (up,) = [ln for ln in lines if ln["event"] == "listening"]
    assert up["api"] == f"http://127.0.0.1:{port}" and up["admin"] == f"http://127.0.0.1:{port + 1}"
