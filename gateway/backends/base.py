"""The Backend seam: open one upstream attempt and get either a complete body or a stream of SSE payloads."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.routing.request import RoutingRequest
from gateway.upstreams import Target


class AttemptFailed(Exception):
    """One upstream attempt failed. What it says about the replica and the request (retry elsewhere, or the request
    is at fault and the error goes back to the client) is decided from these facts by `dispatch/retry_policy.py`."""

    def __init__(self, message: str, *, status: int | None = None, timeout: bool = False,
                 connect: bool = False, overloaded: bool = False, param: str | None = None, stalled: bool = False,
                 leg: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.timeout = timeout
        self.connect = connect
        self.overloaded = overloaded
        self.param = param
        self.stalled = stalled  # cut short because the replica was ejected as hung (`dispatch/ejection.py`)
        self.leg = leg  # PD pools (`dispatch/pd.py`): "prefill" (that leg failed) or "decode_kv" (no KV headroom
        # here): not about this replica's health
        self.replica_answered = False  # set by the dispatcher: the replica answered other requests meanwhile


class StreamBroken(Exception):
    """The upstream stream failed after the first event reached the client."""


class ReadSink(Protocol):
    """Where a pushed stream's reads go (`PushReads.start`), called from the HTTP client's read callback."""

    def read(self, payloads: list[bytes]) -> None:
        """The payloads of one network read (one or more events)."""

    def end(self, err: StreamBroken | None) -> None:
        """The stream ended (None), or broke (an error, the idle timeout, a malformed event); nothing follows."""


class PushReads(Protocol):
    """A stream's reads after its first payload, handed to a sink from the HTTP client's read callback rather than
    awaited by a task (`backends/push.py`): no future, no task wakeup per read."""

    def start(self, sink: ReadSink) -> None:
        """Begin: what already arrived is handed over at once, then each read as it arrives."""

    def pause(self) -> None:
        """Hand nothing more until `resume` (the client's socket pushed back); the upstream is not read meanwhile,
        and its silence then is not counted by the idle timeout."""

    def resume(self) -> None: ...

    def stop(self) -> None:
        """Hand nothing more, ever (idempotent): the relay ended, or its client left."""


@dataclass
class Opened:
    """A successful attempt: for streams the first payload and the rest; else the parsed JSON body."""

    first: bytes | None
    rest: AsyncIterator[bytes] | None
    body: dict[str, Any] | None
    close: Callable[[], Awaitable[None]]
    # what the backend chose for this attempt that the client is told (a PD pool: the pair decision's branch and
    # prefill rank, sent as x-gateway-pd)
    choice: str | None = None
    # the same stream as `rest`, a list of payloads per network read (a relay that takes a read at a time);
    # None: a backend without it (the relay reads `rest` then). One of `rest`, `reads`, `push` is consumed.
    reads: AsyncIterator[list[bytes]] | None = None
    # the same stream pushed from the HTTP client's read callback (`PushReads`); None: a backend without it
    push: PushReads | None = None


@dataclass(frozen=True)
class UpstreamCall:
    endpoint: str  # chat/completions | completions
    body: dict[str, Any]  # the client's body, already adapted for this upstream (model, stream_options)
    stream: bool
    request_id: str
    first_byte_timeout: float
    headers: dict[str, str] = field(default_factory=dict)  # extra request headers (W3C traceparent)
    routing: RoutingRequest | None = None  # the request as routed (a PD pool's pair decision reads its prefix data)


class Backend(Protocol):
    async def open(self, target: Target, call: UpstreamCall) -> Opened: ...
