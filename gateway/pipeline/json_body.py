"""A request body's JSON, parsed at the edge: one object, nested at most `max_depth` levels (400 otherwise).

A large body's parse runs in a worker process (gateway/offload.py): orjson holds the GIL for the whole of it
(~30 ms for 8 MB), so in a thread it would hold the event loop just as long. The worker sends the object back in
slices (`parse_sliced`): the body without its long top-level arrays, then those arrays a few hundred KiB at a time,
each a pickle the event loop loads in well under a millisecond (`Sliced.add`), with other work in between. The
object rebuilt is equal to `parse_json`'s, keys in the same order; an error is the same InvalidRequest.

This module imports orjson and the error tree only: it is all a worker process loads.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import InvalidRequest

# Nesting deeper than this is refused at parse time: orjson re-serialises at most 254 levels (and Python's own
# recursion is finite), so a bound well below that means nothing downstream can fail on a body we accepted.
MAX_JSON_DEPTH = 64
SLICE_BYTES = 256 * 1024  # about this much of the body per slice the event loop loads at once


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e):
            raise _too_deep(max_depth) from None
        raise InvalidRequest(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    # nesting depth is at most the number of opening brackets (those inside strings only over-count), so the
    # walk runs only for a body that could be too deep; bytes.count is C-speed
    if raw.count(b"{") + raw.count(b"[") > max_depth and _deeper_than(body, max_depth):
        raise _too_deep(max_depth)
    return body


def _too_deep(limit: int) -> InvalidRequest:
    return InvalidRequest(f"The request body nests JSON deeper than the gateway's limit of {limit} levels.",
                          code="json_too_deep")


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether any container in `obj` sits more than `limit` levels deep (the top object is level 1). Iterative,
    so the check itself cannot hit a recursion limit; it visits containers only, never string contents."""
    stack: list[tuple[Iterable[Any], int]] = [(obj.values() if isinstance(obj, dict) else obj, 1)]
    while stack:
        items, depth = stack.pop()
        for v in items:
            if isinstance(v, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((v.values() if isinstance(v, dict) else v, depth + 1))
    return False


@dataclass
class Sliced:
    """A parsed body in pickled slices: `head`, the object with each long top-level array emptied, and `parts`,
    (key, a run of that array's items) in order. Pickles of plain JSON values (dicts, lists, strings, numbers)."""

    head: bytes
    parts: list[tuple[str, bytes]] = field(default_factory=list)

    def rebuilding(self) -> Iterator[dict[str, Any]]:
        """The body, loaded one slice at a time: the same object is yielded once its head is loaded and again after
        each part is added (a caller may let other work run in between); once exhausted, it is whole."""
        body: dict[str, Any] = pickle.loads(self.head)
        yield body
        for key, blob in self.parts:
            body[key].extend(pickle.loads(blob))
            yield body

    def whole(self) -> dict[str, Any]:
        *_, body = self.rebuilding()
        return body


def parse_sliced(raw: bytes, max_depth: int = MAX_JSON_DEPTH, slice_bytes: int = SLICE_BYTES) -> Sliced:
    """`parse_json(raw, max_depth)` (raising what it raises), as `Sliced`: a top-level array is cut into runs of
    about `slice_bytes` of the body each (its items' count in proportion to the body's size)."""
    body = parse_json(raw, max_depth)
    head: dict[str, Any] = {}
    parts: list[tuple[str, bytes]] = []
    for key, value in body.items():
        run = max(1, slice_bytes * len(value) // max(len(raw), 1)) if isinstance(value, list) else 0
        if not run or run >= len(value):
            head[key] = value
            continue
        head[key] = []
        parts += [(key, pickle.dumps(value[i:i + run], pickle.HIGHEST_PROTOCOL)) for i in range(0, len(value), run)]
    return Sliced(pickle.dumps(head, pickle.HIGHEST_PROTOCOL), parts)
