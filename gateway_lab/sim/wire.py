"""JSON in and out of the simulated server: bounded body reads, SGLang's error envelope, the API key check, and the
responses that cut a connection or refuse a full queue."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.asgi import AbortConnection
from gateway_lab.sim.protocol import ChunkWriter, SimHTTPError, error_body
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.validation import MAX_BODY_BYTES


def error_response(status: int, message: str, type_: str | None = None) -> Response:
    e = SimHTTPError(status, message, type_)
    return Response(error_body(status, e.message, e.type), status_code=status, media_type="application/json")


OFFLOAD_BYTES = 1 << 20  # bodies above this are parsed off the event loop


MAX_JSON_CONTAINERS = 300_000  # JSON parsing holds the GIL: millions of tiny arrays would stall every replica [inf]


def decode_body(raw: bytes) -> dict[str, Any]:
    # counted on the raw bytes (brackets inside strings count too: a loose, cheap upper bound)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS:
        raise SimHTTPError(400, f"Request body has more than {MAX_JSON_CONTAINERS} JSON arrays and objects.", "BadRequestError")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise SimHTTPError(400, f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise SimHTTPError(400, "1 validation error for request\n  Input should be a valid dictionary")
    return body


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def authorized(replica: Replica, request: Request) -> bool:
    key = replica.cfg.api_key
    return key is None or request.headers.get("authorization") == f"Bearer {key}"


async def read_json(request: Request) -> dict[str, Any]:
    return decode_body(await raw_body(request))


async def raw_body(request: Request) -> bytes:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise SimHTTPError(400, f"Unsupported Content-Type: {ctype or 'missing'}. Expected application/json.")
    raw = bytearray()
    async for part in request.stream():  # bounded: a huge body is refused before it is all in memory
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise SimHTTPError(400, f"Request body exceeds the simulator's limit of {MAX_BODY_BYTES} bytes.", "BadRequestError")
    return bytes(raw)


class Reset(Response):
    """A crash as close as ASGI allows: the status line goes out, then the connection is cut with no body."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]})
        raise AbortConnection("simulated crash")


def queue_full_stream() -> Response:
    body = ChunkWriter.error("The request queue is full.", "SERVICE_UNAVAILABLE", 503) + ChunkWriter.DONE
    return Response(body, media_type="text/event-stream")
