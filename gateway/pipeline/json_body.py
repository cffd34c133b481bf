"""A request body's JSON, parsed at the edge: one object, nested at most `max_depth` levels (400 otherwise).

A large body's parse runs in a worker process (gateway/offload.py): orjson holds the GIL for the whole of it
(~30 ms for 8 MB), so in a thread it would hold the event loop just as long. The worker sends what it made of the
body (the body itself, or its front half's result, pipeline/front.py) back in slices (`slice_value`): the value with
its long lists emptied, then those lists a few hundred KiB at a time, each a pickle the event loop loads in well
under a millisecond (`Sliced.rebuilding`), with other work in between. The object rebuilt is equal to the worker's,
keys in the same order; an error is the same InvalidRequest.

This module imports orjson and the error tree only; a worker process loads it, and the module of whatever job it runs.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import InvalidRequest

# Nesting deeper than this is refused at parse time: orjson re-serialises at most 254 levels (and Python's own
# recursion is finite), so a bound well below that means nothing downstream can fail on a body we accepted.
MAX_JSON_DEPTH = 64
SLICE_BYTES = 256 * 1024  # about this much of the body per slice the event loop loads at once
COUNT_BYTES = 4096  # a body up to this size is screened for depth by counting its brackets (parse_json)
WALK_ITEMS = 256  # a larger one is walked; its brackets are counted only once the walk meets more items than this


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
    # Depth is at most the number of opening brackets (those inside strings only over-count), so the walk need
    # only run for a body that could be too deep. Counting them reads every byte twice: for a small body that is
    # the cheapest screen, but a large one's bulk is mostly its strings (a 13k-token prompt: 52 KB, ~30 us to count
    # on a 2-core VM, twice orjson's parse), so its items are walked first and its bytes counted only when they
    # are many (WALK_ITEMS).
    if len(raw) <= COUNT_BYTES:
        deeper = raw.count(b"{") + raw.count(b"[") > max_depth and _deeper_than(body, max_depth)
    else:
        deeper = _deeper_than(body, max_depth, lambda: raw.count(b"{") + raw.count(b"[") > max_depth)
    if deeper:
        raise _too_deep(max_depth)
    return body


def _too_deep(limit: int) -> InvalidRequest:
    return InvalidRequest(f"The request body nests JSON deeper than the gateway's limit of {limit} levels.",
                          code="json_too_deep")


def _deeper_than(obj: Any, limit: int, may_be: Callable[[], bool] | None = None) -> bool:
    """Whether any container in `obj` sits more than `limit` levels deep (the top object is level 1). Iterative,
    so the check itself cannot hit a recursion limit; it visits containers only, never string contents. `may_be`:
    asked once, if the walk meets more than WALK_ITEMS items, whether the body can be too deep at all (False ends
    the walk: not too deep)."""
    stack: list[tuple[Any, int]] = [(obj.values() if isinstance(obj, dict) else obj, 1)]
    left = WALK_ITEMS if may_be is not None else -1
    while stack:
        values, depth = stack.pop()
        if left >= 0:
            left -= len(values)
            if left < 0 and may_be is not None and not may_be():
                return False
        for v in values:
            if isinstance(v, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((v.values() if isinstance(v, dict) else v, depth + 1))
    return False


def bulk_lists(value: Any) -> list[list[Any]]:
    """The long lists a value carries at its top: a JSON object's top-level arrays, or what an object with a
    `bulk_lists()` method names (a large body's front half, pipeline/front.py: the chat body's arrays, a Responses
    turn's items). Each list once, in a fixed order (the same for the value and for its pickled copy)."""
    lists = value.bulk_lists() if hasattr(value, "bulk_lists") else \
        [v for v in value.values() if type(v) is list] if isinstance(value, dict) else []
    out: list[list[Any]] = []
    for v in lists:
        if not any(v is o for o in out):
            out.append(v)
    return out


@dataclass
class Sliced:
    """A value in pickled slices: `head`, the value with each of its long lists (`bulk_lists`) emptied, and `parts`,
    (which list, a run of its items) in order. Pickles of plain values (JSON values, the front half's dataclasses)."""

    head: bytes
    parts: list[tuple[int, bytes]] = field(default_factory=list)

    def rebuilding(self) -> Iterator[Any]:
        """The value, loaded one slice at a time: the same object is yielded once its head is loaded and again after
        each part is added (a caller may let other work run in between); once exhausted, it is whole."""
        value = pickle.loads(self.head)
        yield value
        lists = bulk_lists(value) if self.parts else []
        for i, blob in self.parts:
            lists[i].extend(pickle.loads(blob))
            yield value

    def whole(self) -> Any:
        *_, value = self.rebuilding()
        return value


def slice_value(value: Any, size: int, slice_bytes: int = SLICE_BYTES) -> Sliced:
    """`value` as `Sliced`: each of its long lists cut into runs of about `slice_bytes` of a `size`-byte body each
    (its items' count in proportion to the body's size). The lists are emptied in place: `value` is the caller's to
    give away (a worker process's own)."""
    parts: list[tuple[int, bytes]] = []
    for i, items in enumerate(bulk_lists(value)):
        run = max(1, slice_bytes * len(items) // max(size, 1))
        if run >= len(items):
            continue
        whole = items[:]
        items.clear()
        parts += [(i, pickle.dumps(whole[j:j + run], pickle.HIGHEST_PROTOCOL)) for j in range(0, len(whole), run)]
    return Sliced(pickle.dumps(value, pickle.HIGHEST_PROTOCOL), parts)


def as_is(body: dict[str, Any]) -> dict[str, Any]:
    """The parsed body itself: the front half of a request whose later steps run elsewhere."""
    return body


def run_front(raw: bytes, max_depth: int, job: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """`job(parse_json(raw, max_depth), *args)`: a request's front half, the same function inline, on a thread or in
    a worker process (gateway/offload.py `CpuPool.front`). `job` and `args` are plain data: a module-level function
    and values that pickle."""
    return job(parse_json(raw, max_depth), *args)


def run_front_sliced(raw: bytes, max_depth: int, job: Callable[..., Any], args: tuple[Any, ...],
                     size: int = 0) -> Sliced:
    """`run_front` in a worker process, its result sent back in slices (`slice_value`; `size`: the bytes the job
    worked on, if more than the body's); a result with an `encode_bulk()` method (api/responses/front.py) first
    encodes there what the event loop would otherwise serialise."""
    value = run_front(raw, max_depth, job, args)
    encode = getattr(value, "encode_bulk", None)
    if encode is not None:
        encode()
    return slice_value(value, max(size, len(raw)))
