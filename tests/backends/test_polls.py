"""The polls' GET over the lean HTTP/1.1 client (backends/h1.py `H1Pool.get`, backends/polls.py): against loopback
servers that misbehave (a body without end, one that never answers, one that resets, one that answers what is not
JSON) every call ends, bounded, with an error the poller and the health checker already handle; and neither of them
ends its loop or keeps a stale reading."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from gateway.backends.engine_poller import EnginePoller
from gateway.backends.h1 import H1ConnectError, H1Dropped, H1Error, H1Pool, H1Timeout, H1TooLarge
from gateway.backends.health import HealthChecker
from gateway.backends.polls import PollClient
from gateway.config import HealthChecks, parse_config
from gateway.observability.metrics import GatewayMetrics
from gateway.upstreams import UpstreamRegistry
from tests.gateway_fixtures import config, sglang_pool
from tests.support import free_port

GUARD_S = 30.0  # a hang fails the test here instead of holding the run
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Raw"], Awaitable[None]]


class Raw:
    """A loopback TCP server whose every connection `handler` serves, counting connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof = asyncio.Event()  # a connection the client closed
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Raw:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        self.requests.append(head)
        return head

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def until_eof(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.eof.set()


def answer(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n" % (status, len(body), extra) + body


def keep_alive(body: bytes) -> Handler:
    async def h(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        while await srv.request(reader) is not None:
            writer.write(answer(200, body))
            await writer.drain()
    return h


async def guarded(aw: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(aw, GUARD_S)


async def test_a_get_reads_the_answer_and_keeps_the_connection() -> None:
    async with Raw(keep_alive(b'{"loads": []}')) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            for _ in range(3):
                status, body = await guarded(pool.get("/v1/loads", {"authorization": "Bearer k"}, 2.0, 1024))
                assert (status, body) == (200, b'{"loads": []}')
            assert srv.connections == 1 and len(srv.requests) == 3
            assert srv.requests[0].startswith(b"GET /v1/loads HTTP/1.1\r\n")
            assert b"authorization: Bearer k\r\n" in srv.requests[0]
        finally:
            pool.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
async def test_a_body_over_the_bound_is_cut_and_its_connection_closed(framing: str) -> None:
    async def endless(writer: asyncio.StreamWriter, srv: Raw) -> None:
        head = {"content-length": b"content-length: 1000000000\r\n", "chunked": b"transfer-encoding: chunked\r\n",
                "until-close": b"connection: close\r\n"}[framing]
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n")
        chunk = b"x" * 65536
        try:
            while not srv.eof.is_set():  # until the client hangs up
                writer.write(b"10000\r\n" + chunk + b"\r\n" if framing == "chunked" else chunk)
                await writer.drain()
        except ConnectionError:
            pass

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        await srv.request(reader)
        sender = asyncio.ensure_future(endless(writer, srv))
        await srv.until_eof(reader)
        await sender

    async with Raw(serve) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            with pytest.raises(H1TooLarge):
                await guarded(pool.get("/metrics", {}, GUARD_S, 1 << 20))
            await guarded(srv.eof.wait())  # the client closed it: not read on, not pooled
            assert not pool._idle
        finally:
            pool.close()


async def test_a_server_that_never_answers_meets_the_deadline() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        await srv.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")  # the headers, then nothing more
        await srv.until_eof(reader)

    async with Raw(silent) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            with pytest.raises(H1Timeout) as e:
                await guarded(pool.get("/v1/loads", {}, 0.2, 1024))
            assert not e.value.connecting
            await guarded(srv.eof.wait())
        finally:
            pool.close()


async def test_a_reset_mid_answer_is_an_error_and_a_refused_connect_is_told_apart() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        await srv.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"lo")
        await writer.drain()
        writer.transport.abort()  # RST

    async with Raw(reset) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            with pytest.raises(H1Error) as e:
                await guarded(pool.get("/v1/loads", {}, GUARD_S, 1024))
            assert not isinstance(e.value, (H1Timeout, H1TooLarge, H1ConnectError))
        finally:
            pool.close()
    refused = H1Pool("127.0.0.1", free_port())
    with pytest.raises(H1ConnectError):
        await guarded(refused.get("/ping", {}, GUARD_S, 1024))


async def test_a_pooled_connection_the_server_closed_is_replaced_once() -> None:
    """The server answers once and keeps the connection, then closes it on the next request without answering (its
    keep-alive ran out as the request went): the GET goes again on a fresh connection. A fresh connection that does
    the same is an error, not a loop."""
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        if await srv.request(reader) is not None and srv.connections == 1:
            writer.write(answer(200, b"first"))
            await writer.drain()
            await srv.request(reader)
            return  # closed without a byte
        if srv.connections == 2:
            writer.write(answer(200, b"second"))
            await writer.drain()

    async with Raw(once) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            assert await guarded(pool.get("/p", {}, GUARD_S, 1024)) == (200, b"first")
            assert await guarded(pool.get("/p", {}, GUARD_S, 1024)) == (200, b"second")
            assert srv.connections == 2
        finally:
            pool.close()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        await srv.request(reader)

    async with Raw(mute) as srv:
        pool = H1Pool("127.0.0.1", srv.port)
        try:
            with pytest.raises(H1Dropped):
                await guarded(pool.get("/p", {}, GUARD_S, 1024))
            assert srv.connections == 1
        finally:
            pool.close()


async def test_the_poll_client_fails_as_httpx_does() -> None:
    """What the poller and the health checker catch: refused is ConnectError, a deadline ReadTimeout, a body over
    the bound or a reset a transport error, malformed JSON a ValueError at .json()."""
    async def by_path(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        while (head := await srv.request(reader)) is not None:
            path = head.split(b" ")[1]
            if path == b"/slow":
                await srv.until_eof(reader)
                return
            if path == b"/reset":
                writer.transport.abort()
                return
            writer.write(answer(200, {b"/big": b"x" * 4096, b"/bad": b'{"loads": [', b"/text": b"caf\xc3\xa9 \xff"}[path]))
            await writer.drain()

    async with Raw(by_path) as srv, httpx.AsyncClient(trust_env=False) as fallback:
        gets = PollClient(fallback, max_body=1024)
        try:
            with pytest.raises(httpx.ReadTimeout):
                await guarded(gets.get(f"{srv.url}/slow", headers={}, timeout=0.2))
            with pytest.raises(httpx.ReadError):
                await guarded(gets.get(f"{srv.url}/big", headers={}, timeout=GUARD_S))
            with pytest.raises(httpx.TransportError):
                await guarded(gets.get(f"{srv.url}/reset", headers={}, timeout=GUARD_S))
            r = await guarded(gets.get(f"{srv.url}/bad", headers={}, timeout=GUARD_S))
            assert r.status_code == 200
            with pytest.raises(ValueError):
                r.json()
            assert (await guarded(gets.get(f"{srv.url}/text", headers={}, timeout=GUARD_S))).text == "café \ufffd"
            with pytest.raises(httpx.ConnectError):
                await guarded(gets.get(f"http://127.0.0.1:{free_port()}/ping", headers={}, timeout=GUARD_S))
        finally:
            gets.close()


class Facts:
    """Where the poller's findings about the prefix index go (`ReplicaFacts`), kept to be read."""

    def __init__(self) -> None:
        self.replaced: list[str] = []
        self.capacity: dict[str, int] = {}

    async def replica_replaced(self, key: str) -> None:
        self.replaced.append(key)

    def replica_capacity(self, key: str, chunks: int) -> None:
        self.capacity[key] = chunks


LOADS = b'{"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_waiting_uncached_tokens": 300, "token_usage": 0.25}]}'


async def test_the_poller_takes_a_bad_answer_as_no_answer_and_goes_on() -> None:
    """Each bad /v1/loads answer (not JSON, JSON of another shape, too big, reset, too slow) leaves the server
    unreachable with no load, and the next good answer is read: the poll never raises (a list once ended the loop)."""
    bad = [b"not json", b"[1, 2]", b"null", b'{"loads": [7]}', b'{"loads": ' + b" " * 4096 + b"[]}", b"RESET", b"SLOW"]
    state = {"loads": LOADS}

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        while (head := await srv.request(reader)) is not None:
            path = head.split(b" ")[1]
            body = b'{"version": "0.5.23", "max_total_num_tokens": 65536}' if path == b"/server_info" else state["loads"]
            if body == b"RESET":
                writer.transport.abort()
                return
            if body == b"SLOW":
                await srv.until_eof(reader)
                return
            writer.write(answer(200, body))
            await writer.drain()

    async with Raw(engine) as srv, httpx.AsyncClient(trust_env=False) as client:
        reg = UpstreamRegistry(parse_config(config([sglang_pool("p", [srv.url])])))
        facts = Facts()
        poller = EnginePoller(reg, client, facts, 256, 1.0, gets=PollClient(client, max_body=1024))
        try:
            await guarded(poller.poll_once())
            t = reg.servers()["p-0"][0]  # as the start-up read left it
            assert facts.capacity == {t.index_key: 65536 // 256}  # /server_info went over the poll client too
            assert t.state.engine_load is not None and t.state.engine_load.inflight == 3.0 and t.state.kv_usage == 0.25
            for body in bad:
                state["loads"] = body
                await guarded(poller.poll_once(info=False))
                assert t.state.engine_load is None and t.state.kv_usage is None, body
                assert not poller._reachable["p-0"], body
                state["loads"] = LOADS
                await guarded(poller.poll_once(info=False))
                assert t.state.engine_load is not None and poller._reachable["p-0"], body
        finally:
            await poller.stop()


async def test_the_health_probe_over_the_poll_client() -> None:
    """200 is up, 401 is up with the key refused, a reset or a probe past its timeout is down (twice: unhealthy),
    and one good answer is healthy again."""
    state = {"answer": b"200"}

    async def ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, srv: Raw) -> None:
        while await srv.request(reader) is not None:
            if state["answer"] == b"RESET":
                writer.transport.abort()
                return
            if state["answer"] == b"SLOW":
                await srv.until_eof(reader)
                return
            writer.write(answer(int(state["answer"]), b""))
            await writer.drain()

    async with Raw(ping) as srv, httpx.AsyncClient(trust_env=False) as client:
        reg = UpstreamRegistry(parse_config(config([sglang_pool("p", [srv.url])])))
        health = HealthChecker(reg, client, HealthChecks(timeout_s=0.2), GatewayMetrics())
        t = reg.targets[0]
        try:
            await guarded(health.check_all())
            assert t.state.healthy and not t.state.credentials_rejected
            state["answer"] = b"401"
            await guarded(health.check_all())
            assert t.state.healthy and t.state.credentials_rejected
            for down in (b"RESET", b"SLOW"):
                state["answer"] = down
                await guarded(health.check_all())
                await guarded(health.check_all())
                assert not t.state.healthy, down
                state["answer"] = b"200"
                await guarded(health.check_all())
                assert t.state.healthy, down
        finally:
            await health.stop()
