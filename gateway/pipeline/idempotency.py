"""`Idempotency-Key`: a client that must not have a request served twice (a retry after a lost answer) says so.

The key is the client's explicit choice, never inferred from `x-request-id` (a correlation id, not an idempotency
key). Per tenant, kept `idempotency.ttl_s` (24 h), up to 255 printable characters; the same key with the same body
(endpoint and JSON, key order aside) is the same request:
- the first is served; if it ends with a 200, its outcome is kept;
- a repeat while it runs: 409 `idempotency_key_in_use` (retry once it completed);
- a repeat after it completed: its outcome again, with `idempotent-replayed: true` — not served, not billed;
- a repeat with another body: 422 `idempotency_key_reused`;
- a first request that failed (any error, a client that left, a stream cut) keeps nothing: a repeat is served.
Streams: a stream that ran to [DONE] is kept as the events it sent, up to `idempotency.max_replay_bytes` (4 MiB), and
replayed at once as one event stream; a longer one's repeats get 409 `idempotency_key_used` (the key has served;
send a new key to ask again). A stream cut before its end keeps nothing, since the client did not get the answer;
what it delivered was billed like any stream that ends early.
Shared through Redis when configured; while Redis is away a request with a key is refused with 503 rather than
risk serving it twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

import orjson
from starlette.responses import Response

from gateway.errors import GatewayError, InvalidRequest, NoCapacity
from gateway.shared_redis import REDIS_ERRORS
from gateway.tenancy.idempotency import Begin, IdempotencyStore, Outcome

log = logging.getLogger("gateway.idempotency")
HEADER = "idempotency-key"
MAX_KEY = 255
STORE_TIMEOUT_S = 1.0
REPLAYED_HEADERS = ("x-gateway-pool", "x-gateway-replica", "x-gateway-attempts", "x-gateway-route",
                    "x-gateway-cost-usd")


class IdempotencyConflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_use"


class IdempotencyMismatch(GatewayError):
    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"


@dataclass
class Held:
    """The key a request holds, and what it sent (recorded for a stream, set once for a JSON answer)."""

    key: str
    fingerprint: str
    max_bytes: int
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    outcome: Outcome | None = None

    def record(self, chunk: bytes) -> None:
        if self.size <= self.max_bytes:
            self.chunks.append(chunk)
            self.size += len(chunk)


def fingerprint(endpoint: str, body: dict[str, object]) -> str:
    canon = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(endpoint.encode() + b"\0" + canon).hexdigest()


async def begin(store: IdempotencyStore | None, max_replay_bytes: int, key: str | None, tenant: str, endpoint: str,
                body: dict[str, object]) -> Held | Response | None:
    """`key`: the client's Idempotency-Key header. None: serve the request (no key, or keys off); a Held: serve it
    holding its key; a Response: the kept outcome to send instead. Raises the 400/409/422/503 above."""
    if key is None or store is None:
        return None
    if not 1 <= len(key) <= MAX_KEY or not key.isprintable() or not key.isascii():
        raise InvalidRequest(f"The Idempotency-Key header must be 1 to {MAX_KEY} printable ASCII characters.",
                             param="Idempotency-Key")
    fp = fingerprint(endpoint, body)
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):
            got, outcome = await store.begin(tenant, key, fp)
    except (*REDIS_ERRORS, TimeoutError) as e:
        raise NoCapacity("Idempotency keys cannot be checked right now (shared state unavailable); retry shortly.",
                         retry_after=1) from e
    if got is Begin.NEW:
        return Held(key, fp, max_replay_bytes)
    if got is Begin.RUNNING:
        raise IdempotencyConflict("A request with this Idempotency-Key is still being served; retry once it "
                                  "completed to get its answer.", param="Idempotency-Key", retry_after=1)
    if got is Begin.MISMATCH:
        raise IdempotencyMismatch("This Idempotency-Key was used with a different request body; use a new key for a "
                                  "new request.", param="Idempotency-Key", should_retry=False)
    assert outcome is not None
    if outcome.status != 200:  # a stream too long to replay
        raise IdempotencyConflict("This Idempotency-Key already served a stream too long to replay; send a new key "
                                  "to ask again.", param="Idempotency-Key", code="idempotency_key_used",
                                  should_retry=False)
    headers = {**outcome.headers, "idempotent-replayed": "true"}
    if outcome.stream:
        return Response(outcome.body, media_type="text/event-stream", headers=headers)
    return Response(outcome.body, media_type="application/json", headers=headers)


def answered(held: Held | None, headers: dict[str, str], body: bytes) -> None:
    """A JSON answer was sent: the outcome a repeat gets, if the request ends well."""
    if held is not None:
        held.outcome = Outcome(200, replayed(headers), body, False)


def streamed(held: Held | None, chunk: bytes) -> None:
    if held is not None:
        held.record(chunk)


def replayed(headers: dict[str, str]) -> dict[str, str]:
    """The response headers a repeat gets again."""
    return {k: v for k, v in headers.items() if k in REPLAYED_HEADERS}


async def end(store: IdempotencyStore, held: Held, tenant: str, request_id: str, ok: bool, stream: bool,
              headers: dict[str, str]) -> None:
    """Keep the outcome of a request that ended well (`ok`), or let its key go."""
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):  # a background task, but the shutdown's drain awaits it
            if ok and stream:
                too_long = held.size > held.max_bytes
                outcome = Outcome(409 if too_long else 200, replayed(headers),
                                  b"" if too_long else b"".join(held.chunks), True)
                await store.complete(tenant, held.key, held.fingerprint, outcome)
            elif ok and held.outcome is not None:
                await store.complete(tenant, held.key, held.fingerprint, held.outcome)
            else:
                await store.abandon(tenant, held.key)
    except REDIS_ERRORS as e:  # the key lapses with its TTL (a repeat meanwhile gets 409); TimeoutError is an OSError
        log.warning("idempotency key of request %s not updated: %s", request_id, type(e).__name__)
