"""A pooled keep-alive connection the server dropped just as it was reused (SGLang's idle timeout) is retried on
the same replica over a fresh connection, `retry.same_replica_retries` times; past that it is a failed attempt."""

import asyncio

import httpx
import pytest

from gateway.backends.base import AttemptFailed, UpstreamCall
from gateway.backends.openai_compat import SGLangBackend, backoff_s
from gateway.config import RetryPolicy, parse_config
from gateway.upstreams import UpstreamRegistry
from tests.gateway_fixtures import config, sglang_pool

OK = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'


async def _server(connections: list[int]) -> tuple[asyncio.Server, int]:
    """Answers the first request on each connection; a second one on the same connection gets it closed, unanswered."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for served in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            await reader.readexactly(n)
            if served:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(OK), OK))
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _two_requests(retries: int) -> tuple[list[int], object]:
    connections: list[int] = []
    server, port = await _server(connections)
    target = UpstreamRegistry(parse_config(config([sglang_pool("s", [f"http://127.0.0.1:{port}"])]))).by_pool["s"][0]
    async with httpx.AsyncClient() as client:
        backend = SGLangBackend(client, RetryPolicy(same_replica_retries=retries, backoff_initial=0.0, jitter=0.0), 5.0, 1.0)
        call = UpstreamCall("chat/completions", {"model": "m", "messages": []}, False, "r1", 5.0)
        first = await backend.open(target, call)
        assert first.body["usage"]["prompt_tokens"] == 1
        try:
            second: object = await backend.open(target, call)  # reuses the pooled connection the server drops
        except AttemptFailed as e:
            second = e
        backend.close()
    server.close()
    return connections, second


def test_a_dropped_pooled_connection_is_retried_on_a_fresh_one():
    connections, second = asyncio.run(_two_requests(retries=1))
    assert not isinstance(second, AttemptFailed), second
    assert len(connections) == 2  # the retry opened a new connection to the same replica


def test_without_same_replica_retries_the_drop_is_a_failed_attempt():
    connections, second = asyncio.run(_two_requests(retries=0))
    assert isinstance(second, AttemptFailed) and "connection dropped" in second.message and second.status is None
    assert len(connections) == 1


@pytest.mark.parametrize("attempt,expected", [(1, 0.02), (2, 0.04), (3, 0.08), (10, 0.5), (10_000, 0.5)])
def test_backoff_doubles_from_the_initial_wait_up_to_the_cap(attempt, expected):
    assert backoff_s(RetryPolicy(backoff_initial=0.02, backoff_max=0.5, jitter=0.0), attempt) == pytest.approx(expected)
    jittered = backoff_s(RetryPolicy(backoff_initial=0.02, backoff_max=0.5, jitter=0.05), attempt)
    assert expected <= jittered <= min(expected + 0.05, 0.5)
