"""A large body's whole front half (parse, translation, validation, rendering, prefix hashes) runs in the worker
process (pipeline/front.py, offload.py `CpuPool.front`): two gateways over loopback, one sending bodies above 8 KiB
there and one doing every step inline, answer the same large bodies byte for byte (ids and times aside), send their
upstream the same body, and refuse the same bad bodies with the same status, body and headers, in each API's shape.
The upstreams are FakeOpenAI (tests/fakes), which records the bodies it is sent."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest

from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, config, start_gateway
from tests.support import ServerThread, wait_until

AUTH = {"authorization": f"Bearer {KEY_A}"}
LIMIT = 10_000_000
WORKER = {"min_body_bytes": 8192, "threads": 1, "processes": 1}
INLINE = {"min_body_bytes": 1 << 30}


class Side:
    def __init__(self, offload: dict[str, Any]) -> None:
        self.fake = FakeOpenAI()
        self.ups = ServerThread([self.fake.app()]).start()
        pool = {"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": self.ups.urls[0] + "/v1"}
        self.gw = start_gateway(config([pool], max_body_bytes=LIMIT, offload=offload,
                                       responses={"auto_truncate_input_tokens": 50_000}))
        self.st = self.gw.app.state.gateway

    def offloaded(self) -> float:
        return float(self.st.metrics.offload_steps.labels("offloaded")._value.get())

    def post(self, path: str, body: bytes) -> httpx.Response:
        headers = {**AUTH, "content-type": "application/json"}
        if path.startswith("/v1/messages"):
            headers["anthropic-version"] = "2023-06-01"
        return httpx.post(self.gw.urls[0] + path, content=body, headers=headers, timeout=60)

    def stop(self) -> None:
        self.gw.stop()
        self.ups.stop()


@pytest.fixture(scope="module")
def sides():
    worker, inline = Side(WORKER), Side(INLINE)
    yield worker, inline
    worker.stop()
    inline.stop()


def turns(n: int, size: int = 400) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w" * size} for i in range(n | 1)]


def body(path: str, stream: bool, n: int = 300, **extra: Any) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": "glm-5.2", "max_tokens": 4, "stream": stream, "messages": turns(n), **extra}
    if path == "/v1/messages":
        return {"model": "glm-5.2", "max_tokens": 4, "stream": stream, "system": "be brief", "messages": turns(n),
                "tools": [{"name": "look", "input_schema": {"type": "object"}}], **extra}
    items = [{"type": "message", "role": t["role"], "content": t["content"]} for t in turns(n)]
    return {"model": "glm-5.2", "max_output_tokens": 4, "stream": stream, "store": False, "input": items,
            "instructions": "be brief", **extra}


# what differs between two answers to the same request: ids the gateway or the upstream mint, and times
_VOLATILE = [
    (re.compile(rb'"(created|created_at|completed_at)":\s*\d+'), rb'"\1":0'),
    (re.compile(rb"\b(resp|msg|chatcmpl|rs|fc|call|toolu|item)[_-][A-Za-z0-9_-]+"), rb"\1_ID"),
    (re.compile(rb'"request_id":\s*"[0-9a-f]+"'), rb'"request_id":"ID"'),
]


def masked(raw: bytes) -> bytes:
    for rx, sub in _VOLATILE:
        raw = rx.sub(sub, raw)
    return raw


HEADERS = ("content-type", "x-should-retry", "retry-after", "x-gateway-dropped")


def same_answer(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code, (a.text[:300], b.text[:300])
    assert masked(a.content) == masked(b.content)
    for h in HEADERS:
        assert a.headers.get(h) == b.headers.get(h), h


def ask_both(sides: tuple[Side, Side], path: str, raw: bytes) -> tuple[httpx.Response, httpx.Response]:
    worker, inline = sides
    before = worker.offloaded(), inline.offloaded()
    for s in sides:
        s.fake.bodies.clear()
    a, b = worker.post(path, raw), inline.post(path, raw)
    assert inline.offloaded() == before[1]  # every step inline there
    if len(raw) >= WORKER["min_body_bytes"]:  # one offloaded step: the whole front half, in the worker process
        assert worker.offloaded() == before[0] + 1
    return a, b


def routed_as(side: Side, request_id: str) -> tuple[Any, ...]:
    """What the router was asked about one request (the admin API's record of it)."""
    recent = side.gw.app.state.proxy.recent
    wait_until(lambda: any(d.request_id == request_id for d in recent), what="the request recorded")
    r = next(d.request for d in recent if d.request_id == request_id)
    assert r is not None
    return r.hashes, r.prompt_tokens, r.max_output_tokens, r.stream, r.group_key


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_large_body_through_the_worker_is_answered_as_inline(sides, path, stream):
    worker, inline = sides
    raw = orjson.dumps(body(path, stream))
    assert len(raw) > 100_000
    a, b = ask_both(sides, path, raw)
    assert a.status_code == 200, a.text
    same_answer(a, b)
    assert worker.fake.bodies and worker.fake.bodies == inline.fake.bodies  # the upstream got the same body
    assert orjson.dumps(worker.fake.bodies[-1]) == orjson.dumps(inline.fake.bodies[-1])
    routed = [routed_as(s, r.headers["x-request-id"]) for s, r in zip(sides, (a, b), strict=True)]  # the router saw the same request: hashes, tokens, cold placement
    assert routed[0] == routed[1] and routed[0][0], routed
    procs = worker.st.cpu._procs
    assert procs is not None and procs._processes, "a worker process ran the front half"


def test_a_stored_turn_continued_by_a_large_body_is_answered_as_inline(sides):
    """store: true, then a large turn naming it: the front half asks for the stored turn, the route loads it and runs
    the front half again with it (in the worker process: the record parsed there too)."""
    first = orjson.dumps(body("/v1/responses", False, n=50, store=True))
    a, b = ask_both(sides, "/v1/responses", first)
    same_answer(a, b)
    ids = a.json()["id"], b.json()["id"]
    answers = []
    for side, prev in zip(sides, ids, strict=True):
        side.fake.bodies.clear()
        before = side.offloaded()
        answers.append(side.post("/v1/responses", orjson.dumps(body("/v1/responses", False, previous_response_id=prev))))
        if side is sides[0]:
            assert side.offloaded() == before + 2  # asked for the stored turn, then ran with it
    same_answer(*answers)
    assert answers[0].status_code == 200
    assert sides[0].fake.bodies == sides[1].fake.bodies
    assert len(sides[0].fake.bodies[-1]["messages"]) > 300  # the stored turn's history went upstream too


def _cut(raw: bytes) -> bytes:
    return raw[:-3]


def refusals() -> list[tuple[str, str, bytes]]:
    big = 8 * 1024 * 1024
    out = []
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        n = big // 420  # an 8 MB body, cut short: not JSON
        out.append((f"malformed 8 MB {path}", path, _cut(orjson.dumps(body(path, False, n=n)))))
        out.append((f"unknown model {path}", path, orjson.dumps(body(path, False, model="nope"))))
        out.append((f"not an object {path}", path, b"[" + b'"x",' * 5000 + b'"x"]'))
    out += [
        ("chat temperature", "/v1/chat/completions", orjson.dumps(body("/v1/chat/completions", False, temperature=5))),
        ("chat bad role", "/v1/chat/completions",
         orjson.dumps(body("/v1/chat/completions", False, messages=turns(300) + [{"role": "x", "content": "y"}]))),
        ("messages without max_tokens", "/v1/messages",
         orjson.dumps({k: v for k, v in body("/v1/messages", False).items() if k != "max_tokens"})),
        ("messages bad stop", "/v1/messages", orjson.dumps(body("/v1/messages", True, stop_sequences=[""]))),
        ("responses bad truncation", "/v1/responses", orjson.dumps(body("/v1/responses", False, truncation="x"))),
        ("responses unknown previous", "/v1/responses",
         orjson.dumps(body("/v1/responses", False, previous_response_id="resp_abc123"))),
        ("responses bad previous", "/v1/responses", orjson.dumps(body("/v1/responses", False, previous_response_id=7))),
        ("responses too deep", "/v1/responses",
         b'{"model":"glm-5.2","x":' + b"[" * 100 + b"]" * 100 + b',"input":"' + b"p" * 10_000 + b'"}'),
    ]
    return out


@pytest.mark.parametrize("case", refusals(), ids=lambda c: c[0])
def test_a_large_bad_body_is_refused_as_inline(sides, case):
    """The same status, body (the API's shape) and headers from the worker process as inline, at the same stage."""
    _, path, raw = case
    assert len(raw) >= WORKER["min_body_bytes"]
    worker, inline = sides
    a, b = ask_both(sides, path, raw)
    assert 400 <= a.status_code < 500, a.text
    same_answer(a, b)
    assert not worker.fake.bodies and not inline.fake.bodies  # refused before any upstream


def test_the_refusal_is_counted_at_the_same_stage(sides):
    """A large chat body the validate stage refuses (its error carried back from the worker and raised there) is
    counted with the same reason as inline."""
    raw = orjson.dumps(body("/v1/chat/completions", False, temperature=5))

    def invalid(side: Side) -> float:
        return float(side.st.metrics.requests.labels("glm-5.2", "none", "tenant-a", "400", "invalid_request",
                                                     "chat")._value.get())

    counts = [invalid(s) for s in sides]
    for s in sides:
        assert s.post("/v1/chat/completions", raw).status_code == 400
    wait_until(lambda: [invalid(s) for s in sides] == [c + 1 for c in counts], what="both counted as invalid_request")


def test_a_small_body_continuing_a_large_stored_turn_is_worked_on_in_the_worker(sides):
    """The stored turn counts toward the size: a short follow-up (what an agent sends) to a long stored conversation
    is parsed, translated and hashed with its history in the worker process, and answered as inline."""
    first = orjson.dumps(body("/v1/responses", False, n=300, store=True))
    a, b = ask_both(sides, "/v1/responses", first)
    same_answer(a, b)
    stored = [httpx.get(f"{s.gw.urls[0]}/v1/responses/{r.json()['id']}/input_items?limit=100&order=asc", headers=AUTH)
              for s, r in zip(sides, (a, b), strict=True)]  # the items as stored (encoded in the worker on one side)
    assert stored[0].status_code == 200 and len(stored[0].json()["data"]) == 100
    same_answer(*stored)
    answers = []
    for side, prev in zip(sides, (a.json()["id"], b.json()["id"]), strict=True):
        side.fake.bodies.clear()
        before = side.offloaded()
        small = orjson.dumps({"model": "glm-5.2", "max_output_tokens": 4, "store": False, "input": "and then?",
                              "previous_response_id": prev})
        assert len(small) < WORKER["min_body_bytes"]
        answers.append(side.post("/v1/responses", small))
        if side is sides[0]:
            assert side.offloaded() == before + 1  # asked for the stored turn inline, then worked on it there
    assert answers[0].status_code == 200, answers[0].text
    same_answer(*answers)
    assert sides[0].fake.bodies == sides[1].fake.bodies and len(sides[0].fake.bodies[-1]["messages"]) > 300
