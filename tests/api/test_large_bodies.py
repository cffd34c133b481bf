"""Large bodies (real gateway over loopback, simulated SGLang replicas): each API has its own body limit, and the
CPU steps of a large body run on the bounded pool — served while the event loop answers everything else, refused
with a 503 in the API's own shape while the pool is full."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import httpx
import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.json_body import parse_json
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

AUTH = {"authorization": f"Bearer {KEY_A}"}


def chat(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * size}]})


def responses(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_output_tokens": 4, "store": False, "input": "y" * size})


def messages(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": "z" * size}]})


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], max_body_bytes=16_384,
                              body_limits={"responses": 200_000, "messages": 100_000},
                              offload={"min_body_bytes": 8192, "threads": 1, "max_queued": 1}))
    yield gw
    gw.stop()
    sims.stop()


def post(gw, path: str, body: bytes) -> httpx.Response:
    return httpx.post(gw.urls[0] + path, content=body, headers=AUTH, timeout=30)


def test_each_api_has_its_own_body_limit(stack):
    """Raising the Responses and Messages limits leaves chat/completions at `max_body_bytes`: one API's large
    histories do not open every API to large bodies; each refusal is a 413 in its API's shape."""
    assert post(stack, "/v1/responses", responses(150_000)).status_code == 200
    assert post(stack, "/v1/messages", messages(80_000)).status_code == 200
    r = post(stack, "/v1/chat/completions", chat(20_000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(stack, "/v1/responses", responses(250_000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(stack, "/v1/messages", messages(120_000))
    assert r.status_code == 413 and r.json()["type"] == "error"


def test_large_body_steps_run_on_the_pool_and_a_full_pool_answers_503(stack):
    """While the pool's one slot is held, the event loop still answers probes and small requests (their steps run
    inline; the GIL switch interval is shortened meanwhile), and a large body is refused at once with 503 +
    Retry-After (529 in Anthropic's shape) instead of queueing; once the slot is free the same large body is served,
    its steps counted as offloaded."""
    st = stack.app.state.gateway
    idle = sys.getswitchinterval()
    release = threading.Event()
    held = stack.call(lambda: asyncio.ensure_future(st.cpu.run(1 << 20, release.wait, 30)))
    try:
        wait_until(lambda: stack.call(lambda: st.cpu.queued) == 1, what="the pool's slot held")
        assert sys.getswitchinterval() == pytest.approx(0.001)  # offload.switch_interval_ms while steps run        assert httpx.get(stack.urls[0] + "/healthz", timeout=5).status_code == 200
        assert post(stack, "/v1/chat/completions", chat(100)).status_code == 200  # small: inline
        r = post(stack, "/v1/chat/completions", chat(10_000))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert "retry-after" in r.headers
        r = post(stack, "/v1/responses", responses(10_000))
        assert r.status_code == 503 and "retry-after" in r.headers
        r = post(stack, "/v1/messages", messages(10_000))
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        release.set()
    wait_until(lambda: held.done() and stack.call(lambda: st.cpu.queued) == 0, what="the slot released")
    assert sys.getswitchinterval() == idle  # the interpreter's own again once idle
    before = st.metrics.offload_steps.labels("offloaded")._value.get()
    assert post(stack, "/v1/chat/completions", chat(10_000)).status_code == 200
    # one step: parse, validate, render and hash together in the worker process (pipeline/front.py)
    assert st.metrics.offload_steps.labels("offloaded")._value.get() == before + 1
    assert st.metrics.offload_steps.labels("refused")._value.get() == 3


def many_turns(path: str, turns: int) -> bytes:
    """A body whose bulk is a long history (what an agent sends), not one long string."""
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 20} for i in range(turns | 1)]
    if path == "/v1/responses":
        return orjson.dumps({"model": "glm-5.2", "max_output_tokens": 4, "store": False, "input": items})
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 4, "messages": items})


def workers(st) -> set[int]:
    procs = st.cpu._procs
    return set() if procs is None else {p.pid for p in procs._processes.values()}


def test_a_large_body_is_parsed_in_a_worker_process_and_answered_as_inline(stack):
    """A large body's JSON is parsed in a worker process (offload.processes) and loaded back in slices: the answer
    is the one a small body gets, and an unparseable or too deeply nested large body is the same 400 the inline
    parse gives, in each API's shape."""
    st = stack.app.state.gateway
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r = post(stack, path, many_turns(path, 200) if path != "/v1/chat/completions" else chat(12_000))
        assert r.status_code == 200, r.text
    assert workers(st), "a worker process parsed the large bodies"
    for pid in workers(st):  # offload.process_niceness (10) above the gateway's own
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    for path in ("/v1/messages", "/v1/responses"):
        broken = many_turns(path, 300)[:-2]  # cut short: not JSON
        with pytest.raises(InvalidRequest) as inline:
            parse_json(broken)
        r = post(stack, path, broken)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] == inline.value.message
        assert (r.json().get("type") == "error") == (path == "/v1/messages")  # Anthropic's shape on /v1/messages
    deep = b'{"model":"glm-5.2","x":' + b"[" * 100 + b"]" * 100 + b',"pad":"' + b"p" * 10_000 + b'"}'
    r = post(stack, "/v1/chat/completions", deep)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"


def test_a_worker_process_that_died_is_replaced_and_no_body_is_lost(stack):
    """The parse worker killed (out of memory, an operator's kill): the next large body is still answered (parsed
    on a thread), and the one after it by a new worker process."""
    st = stack.app.state.gateway
    assert post(stack, "/v1/messages", many_turns("/v1/messages", 200)).status_code == 200
    before = workers(st)
    assert before
    for pid in before:
        os.kill(pid, signal.SIGKILL)  # the gateway's own child, started by this test's gateway
    wait_until(lambda: stack.call(lambda: st.cpu._procs is None or bool(st.cpu._procs._broken)),
               what="the pool noticed its worker died")
    assert post(stack, "/v1/messages", many_turns("/v1/messages", 200)).status_code == 200
    assert post(stack, "/v1/responses", many_turns("/v1/responses", 200)).status_code == 200
    after = workers(st)
    assert after and not after & before
