"""A large body's JSON in slices (pipeline/json_body.py): what the worker process sends back rebuilds the very object
`parse_json` returns, keys in the same order, and an unparseable body raises the same 400."""

import pickle

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.json_body import MAX_JSON_DEPTH, Sliced, as_is, parse_json, run_front_sliced, slice_value

TURN = {"role": "user", "content": [{"type": "text", "text": "lorem ipsum " * 40}]}


def bodies() -> list[bytes]:
    return [
        orjson.dumps({"model": "m", "input": [TURN] * 900, "tools": [{"type": "function", "name": "f"}] * 3,
                      "stream": True, "metadata": {"a": "b"}}),
        orjson.dumps({"messages": [TURN, {"role": "assistant", "content": "x" * 500_000}] * 200, "model": "m",
                      "max_tokens": 4, "system": [{"type": "text", "text": "s"}] * 50}),
        orjson.dumps({"model": "m", "prompt": list(range(150_000)), "n": 1}),
        orjson.dumps({"model": "m", "input": "y" * 2_000_000, "input_items": []}),
        b'{"model": "m", "messages": [1, 2, 3], "messages": [' + b",".join([b'"z"'] * 50_000) + b"]}",  # duplicate key
    ]


@pytest.mark.parametrize("raw", bodies())
def test_the_slices_rebuild_the_parsed_body(raw):
    """Through pickles, as the process pool carries them: equal, key order included, and cut into several slices
    wherever a top-level array is long (never one load of the whole body)."""
    sliced = pickle.loads(pickle.dumps(slice_value(parse_json(raw), len(raw), slice_bytes=64 * 1024)))
    body = sliced.whole()
    assert body == parse_json(raw)
    assert list(body) == list(parse_json(raw))
    if any(isinstance(v, list) and len(v) > 1 for v in parse_json(raw).values()):
        assert len(sliced.parts) > 1 and max(len(b) for _, b in sliced.parts) < len(raw) / 2


def test_a_body_without_long_arrays_is_one_slice():
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    sliced = run_front_sliced(raw, MAX_JSON_DEPTH, as_is, ())  # what the worker process runs
    assert sliced.parts == [] and Sliced(sliced.head).whole() == parse_json(raw)


@pytest.mark.parametrize("raw", [b"", b"[1]", b"{", b'{"max_tokens": NaN}', b'{"a":' + b"[" * 70 + b"]" * 70 + b"}"])
def test_an_unparseable_body_raises_the_same_400_after_a_trip_through_pickle(raw):
    """The worker's InvalidRequest crosses back pickled: message, code and status as parse_json raises them."""
    with pytest.raises(InvalidRequest) as direct:
        parse_json(raw)
    with pytest.raises(InvalidRequest) as sliced:
        run_front_sliced(raw, MAX_JSON_DEPTH, as_is, ())
    back = pickle.loads(pickle.dumps(sliced.value))
    assert type(back) is InvalidRequest and back.body() == direct.value.body() and back.status == 400
    assert back.headers() == direct.value.headers()
    if raw.startswith(b'{"a"'):
        assert back.code == "json_too_deep" and str(MAX_JSON_DEPTH) in back.message
