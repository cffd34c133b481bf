"""The exchange and the outcome (pipeline/exchange.py, pipeline/outcome.py), through a real gateway over loopback to
simulated replicas: the exchange is complete once `Pipeline.admit` returns and nothing writes it afterwards; what is
learned as the answer arrives goes into the request's Outcome, which accounting reads beside it."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Outcome
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import free_port, start_sims, wait_until


@pytest.fixture(scope="module")
def gw():
    sims, _ = start_sims(1)
    dead = sglang_pool("d", [f"http://127.0.0.1:{free_port()}"])  # nothing listens: every attempt fails
    gw = start_gateway(config([sglang_pool("p", sims.urls), dead],
                              models=[{"name": "glm-5.2", "pools": ["p"]}, {"name": "dead", "pools": ["d"]}]))
    yield gw
    gw.stop()
    sims.stop()


class Watch:
    """Wraps the gateway's own `admit` and `Accounting.finish`: what each exchange held when admit returned, and what
    the exchange and the outcome held when accounting ran."""

    def __init__(self, gw: Any) -> None:
        self.pipeline = gw.app.state.proxy
        self.admitted: dict[str, dict[str, Any]] = {}
        self.finished: list[tuple[Exchange, dict[str, Any], Outcome]] = []
        admit, finish = self.pipeline.admit, self.pipeline.accounting.finish

        async def watched_admit(ex: Exchange, *a: Any, **kw: Any) -> None:
            await admit(ex, *a, **kw)
            self.admitted[ex.id] = snapshot(ex)

        async def watched_finish(ex: Exchange, out: Outcome, disconnected: bool) -> None:
            self.finished.append((ex, snapshot(ex), out))
            await finish(ex, out, disconnected)

        self.pipeline.admit, self.pipeline.accounting.finish = watched_admit, watched_finish

    def close(self) -> None:
        del self.pipeline.admit, self.pipeline.accounting.finish  # the class's methods again


def snapshot(ex: Exchange) -> dict[str, Any]:
    """Every field: containers by value (a write into them counts), the rest by identity."""
    out: dict[str, Any] = {}
    for f in fields(ex):
        v = getattr(ex, f.name)
        out[f.name] = dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else id(v)
    return out


@pytest.fixture
def watch(gw):
    w = Watch(gw)
    yield w
    w.close()


def post(gw: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.urls[0] + "/v1/chat/completions", content=orjson.dumps(body), timeout=20,
                      headers={"authorization": f"Bearer {KEY_A}", "content-type": "application/json"})


def chat(model: str = "glm-5.2", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **kw}


def ended(watch: Watch, n: int) -> list[tuple[Exchange, dict[str, Any], Outcome]]:
    wait_until(lambda: len(watch.finished) >= n, timeout=10)  # a stream is accounted as its response closes
    return watch.finished


def test_the_exchange_is_not_written_after_admit_the_outcome_holds_the_answer(gw, watch):
    """A non-streamed and a streamed answer: every field of the exchange at accounting is what admit left (the relay
    writes the outcome only), and the outcome holds what the client was told — the replica header, the status, the
    reason, the usage — so accounting needs nothing else."""
    r1 = post(gw, chat())
    r2 = post(gw, chat(stream=True, stream_options={"include_usage": True}))
    assert r1.status_code == r2.status_code == 200
    done = ended(watch, 2)
    for ex, at_finish, out in done:
        assert at_finish == watch.admitted[ex.id], "the exchange was written after admit"
        assert out.headers["x-gateway-replica"] == "p-0" and "x-gateway-replica" not in ex.headers
        assert out.headers["x-request-id"] == ex.headers["x-request-id"]  # the stages' headers, copied
        assert (out.status, out.reason, out.error) == ("200", "ok", None)
        assert out.usage is not None and out.usage["completion_tokens"] >= 1 and out.first_token_at is not None
        assert out.served_by is not None and out.served_by.name == "p-0" and out.attempts == 1
        assert out.accounted
    assert {r.headers["x-gateway-replica"] for r in (r1, r2)} == {"p-0"}
    stream = next(out for ex, _, out in done if ex.parsed.stream)
    assert stream.chunks >= 2  # each upstream payload relayed is counted on the outcome


def test_a_failed_dispatch_is_recorded_on_the_outcome(gw, watch):
    """Every attempt failing: who was tried and why the request ended are on the outcome, the exchange untouched."""
    r = post(gw, chat("dead"))
    assert r.status_code >= 500
    (ex, at_finish, out), = ended(watch, 1)
    assert ex.id in watch.admitted  # routed and dispatched: the failure is the relay's, not a refusal inside admit
    assert at_finish == watch.admitted[ex.id]
    assert out.dispatched is None and out.status == str(r.status_code) and out.error
    # the last target tried, when the dispatcher got as far as one (a replica already marked down is not tried)
    assert out.served_by is None or out.served_by.pool == "d"
    assert out.reason != "ok" and out.accounted

