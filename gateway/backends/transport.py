"""httpx transport on plain asyncio streams.

httpx's default network backend goes through anyio; profiling the gateway showed ~10% of its CPU in anyio's
per-call attribute plumbing (`get_extra_info` builds a dict of lambdas each time httpcore checks whether a pooled
connection has expired). This backend implements httpcore's small network-backend interface directly on asyncio
streams; everything above it (pooling, HTTP/1.1 parsing, timeouts) is still httpx/httpcore.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import typing

import httpcore
import httpx
from httpcore._utils import is_socket_readable

_EXC_MAP: dict[type[BaseException], type[Exception]] = {}


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._sock: socket.socket | None = writer.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            return await asyncio.wait_for(self._reader.read(max_bytes), timeout)
        except TimeoutError:
            raise httpcore.ReadTimeout("read timed out") from None
        except OSError as e:
            raise httpcore.ReadError(str(e)) from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            if timeout is None:
                await self._writer.drain()
            else:
                await asyncio.wait_for(self._writer.drain(), timeout)
        except TimeoutError:
            raise httpcore.WriteTimeout("write timed out") from None
        except OSError as e:
            raise httpcore.WriteError(str(e)) from None

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        try:
            await asyncio.wait_for(self._writer.start_tls(ssl_context, server_hostname=server_hostname), timeout)
        except TimeoutError:
            raise httpcore.ConnectTimeout("TLS handshake timed out") from None
        except (OSError, ssl.SSLError) as e:
            raise httpcore.ConnectError(str(e)) from None
        self._sock = self._writer.get_extra_info("socket")
        return self

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":
            # an idle keep-alive connection that is readable was closed (or sent junk): expired
            return self._reader.at_eof() or (self._sock is not None and is_socket_readable(self._sock))
        if info == "socket":
            return self._sock
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=(local_address, 0) if local_address else None), timeout)
        except TimeoutError:
            raise httpcore.ConnectTimeout("connect timed out") from None
        except OSError as e:
            raise httpcore.ConnectError(str(e)) from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in socket_options or ():
                sock.setsockopt(*opt)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def asyncio_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(limits=limits)
    # httpx has no public hook for the network backend; the pool is rebuilt with the same settings around ours.
    transport._pool = httpcore.AsyncConnectionPool(  # noqa: SLF001
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return transport
