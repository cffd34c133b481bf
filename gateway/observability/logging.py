"""The log stream: one JSON object per line on stderr, for every line the process writes through `logging`.

The lines, told apart by `event`:
- `request`: one per request, served or refused (`log_request`), with its request id and, when tracing is on, the
  trace and span ids of its span, so a line leads to its trace;
- a state change (`log_event`): `breaker` (open / half_open / closed), `ejection`, `drain`, `override`, `pool_override`,
  `policy_reload`, `policy_error`, `policy_recovered`, `redis_away`, `redis_back`, `draining` (SIGTERM), `listening`
  — each its own line, so an on-call can grep or alert on one kind;
- a line logged with `extra={"event": ...}` (dispatch/outliers.py: replica_ejected, replica_returned,
  replica_probe_passed, replica_ejection_held): an event line with those fields and its message in `msg`;
- `log`: anything else logged by the gateway's modules or uvicorn (warnings, errors), its message in `msg`.

Every line has `ts` (ISO 8601, UTC, milliseconds), `level` and `event`; under `gateway serve --workers N` also
`worker` (its index) and `pid`, so the lines of N processes sharing one stream are told apart. Nothing is multi-line: a traceback is folded
into the `exc` field of its line (JSON escapes its newlines). Never a key or prompt text: only ids, names, counts
and timings (callers pass no more)."""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import Any, ClassVar

import orjson

_requests = logging.getLogger("gateway.requests")
_events = logging.getLogger("gateway.events")
# Loggers whose lines go to the JSON stream: the gateway's own (every module logs under "gateway.") and uvicorn's
# (a server error with its traceback would otherwise print plain, multi-line text on the same stream).
STREAMED = ("gateway", "uvicorn", "uvicorn.error")


def iso_utc(t: float) -> str:
    """ISO 8601 in UTC with milliseconds: 2026-11-27T13:05:01.123Z."""
    whole = int(t)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((t - whole) * 1000):03d}Z"


# what every LogRecord carries; anything else on a record came from `extra=`
_RECORD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonLines(logging.Formatter):
    """A record as one JSON line. A record built by `log_request`/`log_event` carries its fields (`record.fields`);
    any other becomes a `log` line with its message; an exception is folded into `exc`."""

    process: ClassVar[dict[str, Any]] = {}  # on every line: a worker's index and pid (`mark_worker`)

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        line: dict[str, Any] = {"ts": iso_utc(record.created), "level": record.levelname.lower(), **self.process}
        if fields is not None:
            line.update(fields)
        elif isinstance(getattr(record, "event", None), str):
            # `log.warning(msg, extra={"event": ..., ...})`: an event line too, its fields from the extras
            line.update({k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS})
            line["msg"] = record.getMessage()
        else:
            line.update({"event": "log", "logger": record.name, "msg": record.getMessage()})
        if record.exc_info:
            line["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            line["exc"] = record.exc_text
        return orjson.dumps(line, default=str).decode()


def mark_worker(index: int | str, pid: int) -> None:
    """Every line this process writes from now on names the worker (`gateway serve --workers`)."""
    JsonLines.process = {"worker": index, "pid": pid}


def setup_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for the gateway's loggers and uvicorn's. Idempotent: a second app in the process (the
    admin listener, a test's second instance) adds no second handler. The gateway's records still propagate (to
    the root logger, which has no handler in `gateway serve`; a test's capture sees them)."""
    for name in STREAMED:
        logger = logging.getLogger(name)
        if not any(isinstance(h.formatter, JsonLines) for h in logger.handlers):
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(JsonLines())
            # uvicorn's own plain-text handler goes: its lines (tracebacks included) come out as JSON instead
            logger.handlers = [x for x in logger.handlers if type(x) is not logging.StreamHandler] + [h]
        if name != "gateway":
            logger.propagate = False
    logging.getLogger("gateway").setLevel(level)


def _emit(logger: logging.Logger, level: int, fields: dict[str, Any]) -> None:
    if logger.isEnabledFor(level):
        # the message is the line's JSON too, so a handler that reads only getMessage() (a test's, a shipper's) sees
        # the same fields; the stream's formatter writes them with the timestamp and level first
        logger.log(level, "%s", _Rendered(fields), extra={"fields": fields})


class _Rendered:
    """The fields as JSON, rendered only if a handler asks for the message."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return orjson.dumps(self.fields, default=str).decode()


def span_ids(span: Any) -> dict[str, str | None]:
    """The trace and span ids of a request's span (hex, as in `traceparent`), or None for each with tracing off."""
    ctx = span.get_span_context() if span is not None else None
    if ctx is None or not ctx.is_valid:
        return {"trace_id": None, "span_id": None}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def log_request(fields: dict[str, Any], span: Any = None) -> None:
    """The request's line: `fields` (request id, tenant, model, status, reason, tokens, timings...) with the span's
    trace and span ids. Level `error` for a 5xx the gateway answered, `info` otherwise (a refusal is the client's)."""
    level = logging.ERROR if str(fields.get("status", "")).startswith("5") else logging.INFO
    _emit(_requests, level, {"event": "request", "request_id": fields.get("request_id"), **span_ids(span), **fields})


def log_event(event: str, level: int = logging.WARNING, **fields: Any) -> None:
    """A state change as its own line: `event` names the kind, `fields` say which thing and why. Warning by
    default: a state change is what an on-call filters for."""
    _emit(_events, level, {"event": event, **fields})
