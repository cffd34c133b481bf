"""The outcome of one request: what is learned as the answer arrives, a value of its own beside the exchange.

The exchange (exchange.py) holds what was asked and what the stages before dispatch returned; it is complete once
`Pipeline.admit` returns and none of its fields is written after that (the held Idempotency-Key it names keeps its
own record of what the answer sent, for a repeat). Everything learned later is here: which target answered
(or was last tried), when the first token came, the upstream's usage and what had to be corrected in it, the response
headers, the HTTP status, why the request ended, and how many upstream payloads were relayed.

Who writes it: the relay (pipeline/relay.py, or the native Responses relay), which fills it over time for a stream
(each event may change it); the stream machinery when a client stalls or a shutdown cuts the stream; the orchestrator
for a request refused after admission, which never reached the relay. Accounting reads it once, at the end, with the
exchange (`Accounting.finish(ex, outcome, disconnected)`), and writes nothing in it but its once-only mark.

It is created before the upstream is asked and handed to the relay rather than returned by it: a client that leaves
cancels the relay mid-way, and accounting must still see the target it had reached (to release its load and close
the upstream), as it must see who was tried when every attempt failed.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from gateway.dispatch.dispatcher import Dispatched


@dataclass
class Outcome:
    """`status` is the HTTP status the client got ("200" for a stream that began, whatever followed); `reason` says
    why it ended (a bounded set, a metric label: ok, client_disconnect, stream_error, client_stall, upstream_*...:
    pipeline/refusal.py). `headers` are the response's: the stages' (copied from the exchange when the answer is
    asked for), then the relay's (which replica answered, after how many attempts, at what cost)."""

    headers: dict[str, str] = field(default_factory=dict)
    dispatched: Dispatched | None = None  # the target that answered, and the upstream's answer (closed by accounting)
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None  # upstream usage, already clamped (pipeline/usage.py)
    usage_anomalies: list[str] = field(default_factory=list)  # what the upstream's usage claimed that was corrected
    status: str = "200"
    reason: str = "ok"
    error: str | None = None
    error_target: Any = None  # the last target tried when dispatch failed (set by the dispatcher on its error)
    error_attempts: int = 0
    chunks: int = 0  # upstream payloads relayed: a stream cut short is billed by them (pipeline/accounting.py)
    # seconds per event of each of a stream's reads after the first token (the first GAP_SAMPLES, set by the relay's
    # framer): the replica's decode steps, apart from the prefills that cut in (dispatch/replica_stats.py `judged_itl`)
    gaps: array[float] | None = None
    accounted: bool = False  # accounting ran (it runs exactly once): the one field accounting writes

    @classmethod
    def answering(cls, headers: dict[str, str]) -> Outcome:
        """The record of an answer about to be asked for: the stages' response headers (a copy: the exchange's stay
        as the stages left them), nothing learned yet."""
        return cls(dict(headers))

    def end(self, reason: str, error: str | None) -> None:
        """The request ends otherwise than well (the HTTP status already sent, or decided by the caller)."""
        self.reason, self.error = reason, error

    @property
    def served_by(self) -> Any:
        """The target that answered, or the last one tried when every attempt failed (None: never dispatched)."""
        return self.dispatched.target if self.dispatched is not None else self.error_target

    @property
    def attempts(self) -> int:
        return self.dispatched.attempts if self.dispatched is not None else self.error_attempts
