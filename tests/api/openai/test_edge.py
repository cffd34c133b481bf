"""The edge over real loopback HTTP: bad input of every layer (the HTTP parser, the body, the JSON, the OpenAI
fields, the admin API) gets an OpenAI-shaped 4xx naming the problem, never a 500, plain text or a held connection;
and the requests around it keep being served."""

import hashlib
import re
import socket
import time

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import hash_key
from gateway.servers import make_server
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims

ADMIN = "admin-edge-token"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
AUTH = {"authorization": f"Bearer {KEY_A}"}
MSG = [{"role": "user", "content": "edge"}]


@pytest.fixture(scope="module")
def sims():
    st, _ = start_sims(2)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def gw(sims):
    from gateway.app import create_admin_app, create_app
    from gateway.config import parse_config

    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]},
                 timeouts={"body_read": 0.5})
    app = create_app(parse_config(cfg))
    admin = create_admin_app(app)
    st = ServerThread([app, admin])
    # the gateway's own listeners (as `gateway serve` builds them): parser errors in the OpenAI shape
    st.servers = [make_server(a, "127.0.0.1", p, timeout_keep_alive=5, openai_errors=True)
                  for a, p in zip((app, admin), st.ports)]
    st.app, st.admin_app, st.admin_url = app, admin, st.urls[1]
    st.start()
    yield st
    st.stop()


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def _split(resp: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


POISON = [
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "n": 1000000}, "n"),
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 1e308}, "max_tokens"),
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 3, "logprobs": 1e308}, "logprobs"),
    ("completions", {"model": "glm-5.2", "prompt": [1099511627776], "max_tokens": 3}, "prompt"),
    ("completions", {"model": "glm-5.2", "prompt": [[], []], "max_tokens": 3}, "prompt"),
    ("chat/completions", {"model": "glm-5.2", "messages": MSG, "tools": [1], "tool_choice": "required"}, "tools[0]"),
    ("chat/completions", {"model": "glm-5.2", "messages": MSG, "temperature": 1e308}, "temperature"),
    ("chat/completions", {"model": "glm-5.2", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
]


@pytest.mark.parametrize("endpoint,body,param", POISON)
def test_poison_bodies_are_refused_at_the_edge_and_the_fleet_keeps_serving(gw, sims, endpoint, body, param):
    """Issue 10/17's poison bodies are 400s naming the field (no replica sees them); a normal request right after
    is served."""
    for stream in (False, True):
        r = httpx.post(f"{gw.urls[0]}/v1/{endpoint}", headers=AUTH, json={**body, "stream": stream}, timeout=10)
        err = _openai_error(r, 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"
    c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
    assert c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3).choices[0].message.content


def test_sdk_sees_bad_request_for_an_out_of_range_field(gw):
    c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3, n=129)
    assert e.value.body["param"] == "n"


@pytest.mark.parametrize("stream", [False, True])
def test_deep_json_is_a_400_naming_the_limit(gw, stream):
    """Nesting between the edge limit and orjson's re-serialisation limit (254) used to parse and then 500 on the
    way upstream; past 1,023 levels orjson itself refuses. All are 400s now, streamed or not."""
    for depth in (65, 300, 1100):
        nested = "[" * depth + "]" * depth
        raw = f'{{"model":"glm-5.2","messages":[{{"role":"user","content":"x"}}],"stream":{str(stream).lower()},' \
              f'"max_tokens":3,"extra":{nested}}}'
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={**AUTH, "content-type": "application/json"},
                       content=raw, timeout=10)
        err = _openai_error(r, 400)
        assert "64" in err["message"] and err["code"] == "json_too_deep"


def _count(gw, reason: str) -> float:
    total = 0.0
    for line in httpx.get(gw.admin_url + "/metrics").text.splitlines():
        if line.startswith("gateway_requests_total{") and f'reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("bad_length", [b"Content-Length: -1\r\n", b"Content-Length: 5\r\nContent-Length: 7\r\n",
                                        b"Content-Length: abc\r\n"])
def test_malformed_content_length_gets_an_openai_error_not_plain_text(gw, bad_length):
    """Refused by the HTTP parser, before any app code: still the OpenAI shape, and counted like any refusal."""
    port = gw.ports[0]
    before = _count(gw, "invalid_http")
    resp = _raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
                + b"\r\nContent-Type: application/json\r\n" + bad_length + b"\r\n{}")
    status, headers, body = _split(resp)
    assert status == 400 and headers["content-type"] == "application/json"
    import orjson

    err = orjson.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http_request"
    assert _count(gw, "invalid_http") == before + 1


def test_a_body_shorter_than_its_content_length_times_out_with_408(gw):
    """A client that declares 100 bytes and sends 10 gets a 408 after the body-read timeout, and the connection is
    closed (the 90 missing bytes are never read as the next request). The admin API reads bodies the same way."""
    for port, path, auth in ((gw.ports[0], "/v1/chat/completions", KEY_A), (gw.ports[1], "/admin/pools/p", ADMIN)):
        method = b"POST" if path.startswith("/v1") else b"PUT"
        resp = _raw(port, method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + auth.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":1}",
                    timeout=30)
        status, headers, body = _split(resp)
        assert status == 408, resp
        assert headers.get("connection") == "close"
        import orjson

        assert orjson.loads(body)["error"]["code"] == "request_timeout"


def test_unknown_v1_paths_check_the_key_first(gw):
    """Without a valid key every /v1 path answers 401 alike, so a probe cannot learn which paths exist."""
    for headers in ({}, {"authorization": "Bearer sk-wrong"}):
        for method, path in (("GET", "/v1/nope"), ("POST", "/v1/secret/thing"), ("GET", "/v1/chat/completions")):
            err = _openai_error(httpx.request(method, gw.urls[0] + path, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
    err = _openai_error(httpx.get(gw.urls[0] + "/v1/nope", headers=AUTH), 404)
    assert err["code"] == "not_found"
    assert _openai_error(httpx.get(gw.urls[0] + "/v1/chat/completions", headers=AUTH), 405)["code"] == \
        "method_not_allowed"


def test_health_is_an_alias_of_liveness(gw):
    for path in ("/health", "/healthz"):
        r = httpx.get(gw.urls[0] + path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("rid,kept", [("abc-123.x:y_Z", True), ("a" * 128, True), ("a" * 129, False),
                                      ("bad id", False), ("<script>", False), ("ünï", False)])
def test_client_request_id_is_bounded(gw, rid, kept):
    """A client's x-request-id is echoed only if it is <= 128 chars of [A-Za-z0-9._:-]; otherwise a fresh id."""
    r = httpx.get(gw.urls[0] + "/healthz", headers={"x-request-id": rid.encode("utf-8")})
    got = r.headers["x-request-id"]
    assert (got == rid) is kept
    if not kept:
        assert len(got) == 32 and got.isalnum()


def _admin(gw, method, path, **kw):
    return httpx.request(method, gw.admin_url + path, headers=ADMIN_H, timeout=10, **kw)


@pytest.mark.parametrize("method,path,body,param", [
    ("PUT", "/admin/pools/p", {"weight": 1e308}, "weight"),
    ("PUT", "/admin/pools/p", {"weight": -1}, "weight"),
    ("PUT", "/admin/tenants/tenant-a/override", {"ttl_s": 60, "ttft_sla_ms": 1e308}, "ttft_sla_ms"),
    ("GET", "/admin/state?uncached_tokens=-1", None, "uncached_tokens"),
    ("GET", "/admin/decisions?limit=0", None, "limit"),
    ("GET", "/admin/audit?limit=1e308", None, "limit"),
])
def test_admin_inputs_out_of_range_are_400(gw, method, path, body, param):
    err = _openai_error(_admin(gw, method, path, json=body), 400)
    assert err["param"] == param


def test_admin_per_token_price_is_bounded():
    """A per-token pool's price override is bounded too (a 1e308 price would poison every cost comparison)."""
    hosted = {"name": "h", "kind": "openai", "model": "glm", "base_url": "http://127.0.0.1:9/v1",
              "pricing": {"type": "per_token", "input_per_mtok": 1, "output_per_mtok": 2}}
    g = start_gateway(config([hosted], admin={"token_hashes": [hash_key(ADMIN)]}, health={"enabled": False}))
    try:
        huge = {"pricing": {"type": "per_token", "input_per_mtok": 1e308, "output_per_mtok": 1}}
        assert _openai_error(_admin(g, "PUT", "/admin/pools/h", json=huge), 400)["param"] == "pricing"
        ok = {"pricing": {"type": "per_token", "input_per_mtok": 1.5, "output_per_mtok": 3}, "weight": 2}
        r = _admin(g, "PUT", "/admin/pools/h", json=ok)
        assert r.status_code == 200 and r.json()["override"]["weight"] == 2
    finally:
        g.stop()


def _admin_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route registered under /admin in `app` (whatever registered it: the admin router or
    anything else), from the FastAPI app under the middleware wrappers."""
    try:  # FastAPI >= 0.137 keeps an included router as one node in app.routes; this flattens it, prefixes applied
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI flattened include_router's routes into app.routes itself
        iter_route_contexts = iter
    while not hasattr(app, "routes"):
        app = app.app
    return sorted((m, r.path) for r in iter_route_contexts(app.routes) if (r.path or "").startswith("/admin")
                  for m in r.methods or ())


def test_every_admin_route_is_401_without_the_admin_token(gw):
    """Every route under /admin on the admin listener, enumerated from the app (not listed here), refuses a caller
    without the admin token or with a wrong one (a client API key is a wrong one), before reading its parameters or
    body: a route added without auth fails this test."""
    routes = _admin_routes(gw.admin_app)
    assert len(routes) >= 15 and ("GET", "/admin/state") in routes and ("POST", "/admin/explain") in routes
    wrong = [None, {"authorization": "Bearer not-the-admin-token"}, {"authorization": f"Bearer {KEY_A}"},
             {"authorization": f"Basic {ADMIN}"}, {"authorization": "Bearer"}]
    for method, template in routes:
        path = re.sub(r"\{[^}]+\}", "x", template)  # any value: auth comes before the path's own checks
        for headers in wrong:
            r = httpx.request(method, gw.admin_url + path, headers=headers, json={"weight": 1}, timeout=10)
            err = _openai_error(r, 401)
            assert err["code"] == "invalid_api_key" and "admin token" in err["message"], (method, path, headers)


def test_the_admin_dependency_names_the_caller_in_the_audit_log(gw):
    """The router's dependency is also the handlers' source of the audit identity: the token's digest prefix plus
    the actor the caller names, never the token."""
    r = httpx.delete(gw.admin_url + "/admin/pools/p", headers={**ADMIN_H, "x-admin-actor": "edge-oncall"}, timeout=10)
    assert r.status_code == 200, r.text
    last = _admin(gw, "GET", "/admin/audit?limit=1").json()["entries"][0]
    assert last["who"] == f"token:{hashlib.sha256(ADMIN.encode()).hexdigest()[:8]} (edge-oncall)"
    assert ADMIN not in str(last)


def test_deleting_an_unknown_tenants_override_is_404_without_an_audit_entry(gw):
    before = _admin(gw, "GET", "/admin/audit").json()["entries"]
    err = _openai_error(_admin(gw, "DELETE", "/admin/tenants/nobody/override"), 404)
    assert err["param"] == "name"
    assert _admin(gw, "GET", "/admin/audit").json()["entries"] == before
    assert _admin(gw, "DELETE", "/admin/tenants/tenant-a/override").status_code == 200  # a known tenant: still fine


def test_an_encoder_failure_on_the_path_is_a_400_not_a_500(gw):
    """Defence in depth behind the depth bound: should re-encoding a body ever fail (orjson's 254-level limit),
    the client gets a 400 in the OpenAI shape. Injected: the handler re-encodes a 300-level structure."""
    import orjson

    proxy = gw.app.state.proxy
    original = proxy.handle

    async def reencoding_handle(request, endpoint):
        deep: list = []
        for _ in range(300):
            deep = [deep]
        orjson.dumps(deep)  # raises orjson.JSONEncodeError (a TypeError)
        return await original(request, endpoint)

    proxy.handle = reencoding_handle
    try:
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH,
                       json={"model": "glm-5.2", "messages": MSG, "max_tokens": 3})
    finally:
        proxy.handle = original
    err = _openai_error(r, 400)
    assert err["code"] == "invalid_body"
    assert httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH,
                      json={"model": "glm-5.2", "messages": MSG, "max_tokens": 3}).status_code == 200


def test_pool_caps_apply_through_the_gateway():
    """Per-pool limits reach the edge: an sglang pool caps n at 8 by default (max_n raises it), and a pool's
    context_tokens bounds max_tokens; both are 400s naming the field, and in-range requests are served."""
    sims, _ = start_sims(1)
    pool = {**sglang_pool("p", sims.urls), "context_tokens": 4096}
    g = start_gateway(config([pool]))
    try:
        c = OpenAI(base_url=g.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3, n=9)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="glm-5.2", prompt="x", max_tokens=4097)
        assert e.value.body["param"] == "max_tokens"
        assert len(c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3, n=8).choices) == 8
    finally:
        g.stop()
        sims.stop()


def test_token_ids_past_the_vocabulary_never_reach_the_engine():
    """With the pool's `vocab_size` set, a prompt of token ids holding one at or past it is a 400 in OpenAI's shape
    naming `prompt` with the gateway's own code, so the replica never saw it ([5, 2048] lies inside the simulator's
    vocabulary: forwarded, it would have been served); real SGLang 0.5.23's scheduler dies on such an id, and the
    engine tier checks the same in front of a real server. Ids inside the vocabulary are served."""
    sims, _ = start_sims(1)
    g = start_gateway(config([{**sglang_pool("p", sims.urls), "vocab_size": 2048}]))
    try:
        url, h = f"{g.urls[0]}/v1/completions", {"authorization": f"Bearer {KEY_A}"}
        for prompt in ([5, 2048], [10_000_000], [[1, 2], [3, 99_999]]):
            r = httpx.post(url, headers=h, json={"model": "glm-5.2", "prompt": prompt, "max_tokens": 1})
            err = _openai_error(r, 400)
            assert err["param"] == "prompt" and err["code"] == "token_id_out_of_vocabulary", err
        r = httpx.post(url, headers=h, json={"model": "glm-5.2", "prompt": [5, 2047], "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        g.stop()
        sims.stop()


def test_a_slow_but_live_body_still_arrives(gw):
    """The body-read timeout bounds the gap between reads (like nginx's client_body_timeout), not the whole upload:
    a body trickling in every 0.2 s for ~2 s (4x the 0.5 s timeout) is served."""
    body = b'{"model":"glm-5.2","messages":[{"role":"user","content":"slow upload"}],"max_tokens":2}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY_A.encode()
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", gw.ports[0]), timeout=30) as s:
        s.sendall(head)
        step = len(body) // 10 + 1
        for i in range(0, len(body), step):
            s.sendall(body[i:i + step])
            time.sleep(0.2)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    status, _, payload = _split(out)
    assert status == 200, out
    assert b'"choices"' in payload


def test_an_exception_escaping_every_handler_is_a_json_500(gw):
    """The outermost middleware answers an exception that escaped before the response started with the OpenAI
    shape and the request id, not uvicorn's plain text. Injected: a handler whose response object fails to send."""
    proxy = gw.app.state.proxy
    original = proxy.handle

    class Broken:
        async def __call__(self, scope, receive, send):
            raise RuntimeError("boom")

    async def broken_handle(request, endpoint):
        return Broken()

    proxy.handle = broken_handle
    try:
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={**AUTH, "x-request-id": "edge-500"},
                       json={"model": "glm-5.2", "messages": MSG, "max_tokens": 3})
    finally:
        proxy.handle = original
    err = _openai_error(r, 500)
    assert err["type"] == "server_error" and "boom" not in r.text
    assert r.headers["x-request-id"] == "edge-500"


def test_max_tokens_above_the_context_the_servers_report_is_refused_at_the_door():
    """With no `context_tokens` in the config, the context length the SGLang servers report in /server_info bounds
    max_tokens at the edge (400 naming the field) once the preflight has read it; below it the request is served."""
    from tests.support import wait_until

    sims, _ = start_sims(1, context_length=4096, enable_cache_report=True)
    gw = start_gateway(config([sglang_pool("mi", sims.urls)]))
    try:
        reg = gw.app.state.gateway.registry
        wait_until(lambda: all(t.context_tokens == 4096 for t in reg.targets), 10, "the preflight's context length")
        body = {"model": "glm-5.2", "prompt": "hi", "max_tokens": 5000}
        r = httpx.post(f"{gw.urls[0]}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = httpx.post(f"{gw.urls[0]}/v1/completions", json={**body, "max_tokens": 4},
                       headers={"authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
    finally:
        gw.stop()
        sims.stop()
