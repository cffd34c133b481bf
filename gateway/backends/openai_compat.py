"""OpenAI-compatible HTTP upstreams (SGLang replicas and hosted endpoints) over a shared pooled httpx client."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from gateway.backends.base import AttemptFailed, Opened, StreamBroken, UpstreamCall
from gateway.backends.h1 import H1ConnectError, H1Dropped, H1Error, H1Pool, H1Response
from gateway.backends.push import UpstreamPush
from gateway.backends.sse import MalformedEvent, SseSplitter
from gateway.config import RetryPolicy
from gateway.upstreams import Target

# Upstream error text reaches clients, logs and traces: keep its class and first lines, never request content.
# pydantic's "[type=..., input_value=<the client's input>, input_type=...]" and long quoted strings are the echoes.
_PYDANTIC_INPUT = re.compile(r"\s*\[type=[^,\]]*(?:,\s*input_value=.*?)?(?:,\s*input_type=[^\]]*)?\]", re.DOTALL)
_QUOTED = re.compile(r"'[^'\n]{40,}'|\"[^\"\n]{40,}\"")
# a provider may echo the credential it refused: anything shaped like a key or a bearer token is masked
_SECRET = re.compile(r"(?i)\bbearer\s+\S+|\b(?:sk|pk|rk|nvapi|key)[-_][A-Za-z0-9_\-]{6,}|\b[A-Za-z0-9_\-]{32,}\b")
MAX_UPSTREAM_TEXT = 300


def sanitize_upstream_text(text: str) -> str:
    """Bounded, single-line upstream error text with echoed input removed."""
    t = _SECRET.sub("[redacted]", _QUOTED.sub("'…'", _PYDANTIC_INPUT.sub("", text)))
    lines = [ln.strip() for ln in t.splitlines() if ln.strip() and not ln.strip().startswith("For further information")]
    t = "; ".join(lines[:4])
    return t if len(t) <= MAX_UPSTREAM_TEXT else t[:MAX_UPSTREAM_TEXT - 1] + "…"


def upstream_message(status: int, raw: bytes) -> tuple[str, str | None]:
    """The message (and param) of an upstream error body: OpenAI's nested shape, SGLang's flat one, or text;
    sanitised (`sanitize_upstream_text`)."""
    msg, param = _raw_message(status, raw)
    return sanitize_upstream_text(msg) or f"upstream returned HTTP {status}", param if isinstance(param, str) else None


def _raw_message(status: int, raw: bytes) -> tuple[str, object]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw[:4096].decode("utf-8", "replace").strip()
        return (text or f"upstream returned HTTP {status}"), None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or f"upstream returned HTTP {status}"), err.get("param")
        if isinstance(err, str):
            return err, None
    return f"upstream returned HTTP {status}", None


class HttpBackend:
    def __init__(self, client: httpx.AsyncClient, retry: RetryPolicy, idle_timeout: float) -> None:
        self.client = client
        self.retry = retry
        self.idle_timeout = idle_timeout

    async def open(self, target: Target, call: UpstreamCall) -> Opened:
        headers = {"content-type": "application/json", "x-request-id": call.request_id, **call.headers}
        if target.api_key:
            headers["authorization"] = f"Bearer {target.api_key}"
        headers.update(target.pin_headers())  # DP rank pinning by header (SGLang 0.5.13+), when so configured
        content = orjson.dumps(call.body)
        url = target.url(call.endpoint)
        # A pooled keep-alive connection may be closed by the server just as we reuse it (SGLang's 5 s idle
        # timeout): that fails before any byte of a response, so the same replica is retried after a short backoff.
        # A plain loop: tenacity's per-request AsyncRetrying.copy() and its iterator were the largest single extra cost.
        r = self.retry
        for n in range(r.same_replica_retries + 1):
            try:
                return await self._once(target, url, content, headers, call)
            except _DroppedConnection as e:
                if n == r.same_replica_retries:
                    raise AttemptFailed(f"connection dropped by {target.name}: {e}") from None
            await asyncio.sleep(backoff_s(r, n + 1))
        raise AssertionError("unreachable")

    async def _once(self, target: Target, url: str, content: bytes, headers: dict[str, str], call: UpstreamCall) -> Opened:
        req = self.client.build_request("POST", url, content=content, headers=headers)
        try:
            async with asyncio.timeout(call.first_byte_timeout):
                resp = await self.client.send(req, stream=True)
        except TimeoutError:
            raise AttemptFailed("upstream did not answer before the first-byte timeout", timeout=True) from None
        except httpx.ConnectError as e:
            raise AttemptFailed(f"cannot connect: {e}", connect=True) from None
        except httpx.ConnectTimeout:
            raise AttemptFailed("connect timeout", connect=True, timeout=True) from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise _DroppedConnection(str(e)) from None
        except httpx.HTTPError as e:
            raise AttemptFailed(f"upstream error: {type(e).__name__}: {e}") from None
        return await self._handle(resp, call)

    async def _handle(self, resp: Any, call: UpstreamCall) -> Opened:
        """Status, body or first event of an upstream response (httpx or H1: the same small interface)."""
        try:
            if resp.status_code != 200:
                raw = await self._read_all(resp, call.first_byte_timeout)
                msg, param = upstream_message(resp.status_code, raw)
                raise AttemptFailed(msg, status=resp.status_code, param=param,
                                    overloaded=resp.status_code in (429, 503))
            if call.stream:
                return await self._open_stream(resp, call)
            raw = await self._read_all(resp, call.first_byte_timeout)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise AttemptFailed("upstream sent a non-JSON body") from None
            await resp.aclose()
            return Opened(None, None, body, resp.aclose)
        except BaseException:
            await resp.aclose()
            raise

    async def _read_all(self, resp: Any, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await resp.aread()  # type: ignore[no-any-return]
        except TimeoutError:
            raise AttemptFailed("upstream body timed out", timeout=True) from None
        except (httpx.HTTPError, H1Error) as e:
            raise AttemptFailed(f"upstream body broken: {type(e).__name__}") from None

    async def _open_stream(self, resp: Any, call: UpstreamCall) -> Opened:
        h1 = resp if isinstance(resp, H1Response) else None
        raw = resp.aiter_raw().__aiter__() if h1 is None else None
        split = SseSplitter()
        try:
            async with asyncio.timeout(call.first_byte_timeout):
                payloads = await _first_read(h1, raw, split)
        except TimeoutError:
            raise AttemptFailed("no first token before the first-byte timeout", timeout=True) from None
        except (httpx.HTTPError, H1Error) as e:
            raise AttemptFailed(f"stream broken before the first event: {type(e).__name__}") from None
        except MalformedEvent as e:  # a protocol failure of this upstream: the next replica may do better
            raise AttemptFailed(f"upstream sent a malformed stream: {e}") from None
        if not payloads:
            raise AttemptFailed("upstream closed the stream before any event") from None
        first = payloads.pop(0)
        if first.startswith(b'{"error"'):
            err = _inband_error(first)
            raise AttemptFailed(err[0], status=err[1], overloaded=err[1] in (429, 503))
        # the rest, to be taken one way: a read at a time by a task (`reads`, `rest`), or pushed (`push`)
        reads = self._reads(h1 if h1 is not None else raw, split, payloads)  # type: ignore[arg-type]
        push = UpstreamPush(h1, split, payloads, self.idle_timeout) if h1 is not None else None
        return Opened(first, _each(reads), None, resp.aclose, reads=reads, push=push)

    async def _reads(self, source: H1Response | AsyncIterator[bytes], split: SseSplitter,
                     pending: list[bytes]) -> AsyncIterator[list[bytes]]:
        """The stream's payloads after the first (which `_open_stream` took: `_first_read`), a list per network read
        (an engine decoding sends an event per read), awaited by the consuming task: `pending` (the first read's
        other payloads), then each read (`split` holds what the first read left of an event). The consumer pays one
        resumption per read, not one per event and layer. (`backends/push.py` relays the same reads without a task.)

        A failure is StreamBroken, and so is an upstream that sends nothing for `idle_timeout`. The idle timeout
        covers only the wait for the next read, never the time between yields: time the consumer takes (a slow
        client) is not the upstream's. It is a watchdog, not a timer per read (asyncio.timeout made
        and cancelled a timer for every event): one timer, which on firing cancels the waiting task if the current
        wait has lasted `idle_timeout`, else sets itself for when that wait would. An H1 response is read directly
        (`poll`), an httpx one through its iterator."""
        h1 = source if isinstance(source, H1Response) else None
        raw = None if isinstance(source, H1Response) else source.__aiter__()
        idle = self.idle_timeout
        loop = asyncio.get_running_loop()
        waiting_since: float | None = None  # when the wait in progress began (None: not waiting)
        waiter: asyncio.Task[Any] | None = None
        expired = False
        timer: asyncio.TimerHandle | None = None
        if pending:  # what the first read brought after the first payload
            taken = pending[:]
            pending.clear()
            yield taken

        def check() -> None:
            nonlocal timer, expired
            timer = None
            since = waiting_since
            if since is None:
                return  # suspended at the yield: the next wait sets the timer again
            if loop.time() - since >= idle:
                expired = True
                assert waiter is not None
                waiter.cancel()
                return
            timer = loop.call_at(since + idle, check)

        cancelling = 0
        ended = False
        try:
            while True:
                try:
                    got = h1.poll() if h1 is not None else None
                    if got.__class__ is not bytes:
                        if waiter is None:  # one task consumes the stream: the relay's
                            waiter = asyncio.current_task()
                            assert waiter is not None
                        cancelling = waiter.cancelling()
                        waiting_since = loop.time()
                        if timer is None:
                            timer = loop.call_at(waiting_since + idle, check)
                        try:
                            if got is not None:
                                got = await got  # type: ignore[misc]  # H1: the next read, or None: poll again
                                if got is None:
                                    continue
                            else:
                                assert raw is not None
                                got = await raw.__anext__()
                                if not got:
                                    continue
                        except StopAsyncIteration:
                            got = b""
                        finally:
                            waiting_since = None
                    data: bytes = got
                    ended = not data
                    payloads = split.end() if ended else split.feed(data)
                except asyncio.CancelledError:
                    # ours (as asyncio.timeout tells): only if nobody else cancelled the task meanwhile
                    if expired and waiter is not None and waiter.uncancel() <= cancelling:
                        raise StreamBroken(f"no chunk from upstream for {idle:.0f} s") from None
                    raise
                except (httpx.HTTPError, H1Error) as e:
                    raise StreamBroken(f"upstream stream broken: {type(e).__name__}") from None
                except MalformedEvent as e:
                    raise StreamBroken(f"upstream sent a malformed event ({e})") from None
                if payloads:
                    yield payloads
                if ended:
                    return
        finally:
            if timer is not None:
                timer.cancel()


async def _first_read(h1: H1Response | None, raw: AsyncIterator[bytes] | None, split: SseSplitter) -> list[bytes]:
    """The payloads of the first read that brings any (none: the stream ended without an event). The transport's
    errors and MalformedEvent are raised as they are: before the first payload they fail the attempt."""
    while True:
        if h1 is not None:
            got = h1.poll()
            if got.__class__ is not bytes:
                got = await got  # type: ignore[misc]
                if got is None:
                    continue
        else:
            assert raw is not None
            try:
                got = await raw.__anext__()
            except StopAsyncIteration:
                got = b""
            else:
                if not got:
                    continue
        data: bytes = got
        if not data:
            return split.end()
        payloads = split.feed(data)
        if payloads:
            return payloads


async def _each(reads: AsyncIterator[list[bytes]]) -> AsyncIterator[bytes]:
    """The payloads one by one, for a consumer that takes them so (the native Responses relay)."""
    async for payloads in reads:
        for payload in payloads:
            yield payload


class SGLangBackend(HttpBackend):
    """SGLang replicas: plain-HTTP ones through the lean HTTP/1.1 client (`h1.py`), one keep-alive pool per
    replica; an https:// replica falls back to httpx."""

    def __init__(self, client: httpx.AsyncClient, retry: RetryPolicy, idle_timeout: float, connect_timeout: float) -> None:
        super().__init__(client, retry, idle_timeout)
        self.connect_timeout = connect_timeout
        self._pools: dict[str, H1Pool] = {}

    def _pool(self, target: Target) -> H1Pool | None:
        pool = self._pools.get(target.base_url)
        if pool is None:
            u = httpx.URL(target.base_url)
            if u.scheme != "http" or not u.host:
                return None
            pool = self._pools[target.base_url] = H1Pool(u.host, u.port or 80)
        return pool

    async def _once(self, target: Target, url: str, content: bytes, headers: dict[str, str], call: UpstreamCall) -> Opened:
        pool = self._pool(target)
        if pool is None:
            return await super()._once(target, url, content, headers, call)
        path = url[len(target.base_url):]
        try:
            async with asyncio.timeout(call.first_byte_timeout):
                resp, _ = await pool.request(path, content, headers, self.connect_timeout)
        except TimeoutError:
            raise AttemptFailed("upstream did not answer before the first-byte timeout", timeout=True) from None
        except H1ConnectError as e:
            raise AttemptFailed(f"cannot connect: {e}", connect=True) from None
        except H1Dropped as e:
            if e.reused:
                raise _DroppedConnection(str(e)) from None
            raise AttemptFailed(f"connection dropped: {e}") from None
        except H1Error as e:
            raise AttemptFailed(f"upstream error: {e}") from None
        return await self._handle(resp, call)

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


def backoff_s(r: RetryPolicy, attempt: int) -> float:
    """The wait after failed attempt number `attempt` (1-based): exponential from `backoff_initial`, plus up to
    `jitter` at random, at most `backoff_max`."""
    return max(0.0, min(r.backoff_initial * 2.0 ** min(attempt - 1, 60) + random.uniform(0, r.jitter), r.backoff_max))


class _DroppedConnection(Exception):
    pass


def _inband_error(payload: bytes) -> tuple[str, int]:
    try:
        err: Any = orjson.loads(payload)["error"]
        code = err.get("code")
        status = code if isinstance(code, int) else 500
        return sanitize_upstream_text(str(err.get("message", "upstream error"))) or "upstream error", status
    except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
        return "upstream sent an error event", 500
