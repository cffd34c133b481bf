"""The front half of a body (pipeline/front.py): one pure function whose result the pipeline's validate and decide
stages use — the same ParsedRequest `validate` returns, the hashes `prefix_hashes` computes, and the decide stage
uses those hashes only when it asks about the very prompt they were computed from."""

from __future__ import annotations

import pickle

import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.front import Front, Hashing, Names, prepare
from gateway.pipeline.json_body import Sliced, slice_value
from gateway.pipeline.validation import validate
from gateway.policy_schema import ModelAlias
from gateway.prefix.hashing import prefix_hashes

NAMES = Names("tenant:a", ("glm-5.2",), (ModelAlias(match="claude-*", model="glm-5.2"),))


def chat(model: str = "glm-5.2", **extra: object) -> dict[str, object]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 300} for i in range(41)]
    return {"model": model, "max_tokens": 4, "messages": msgs, **extra}


def never(*_: object) -> list[int]:
    raise AssertionError("hashed again")


@pytest.mark.parametrize("model", ["glm-5.2", "claude-sonnet-4-5"])
def test_prepare_is_validate_and_prefix_hashes(model):
    """Through a pickle and slices, as the worker process sends it back: the same ParsedRequest, and hashes of the
    served model (an alias resolved) in the tenant's namespace (a client salt included)."""
    body = chat(model, cache_salt="s1")
    sliced = slice_value(prepare(body, "chat/completions", Hashing(NAMES, 64)), 200_000, slice_bytes=16_384)
    assert len(sliced.parts) > 1
    front = pickle.loads(pickle.dumps(sliced)).whole()
    assert isinstance(front, Front) and isinstance(sliced, Sliced)
    assert front.validated() == validate(chat(model, cache_salt="s1"), "chat/completions")
    ns = "tenant:a:s1"
    # (slice_value emptied `body`'s lists: the worker gives its result away)
    assert front.hashed.hashes == prefix_hashes("chat/completions", chat(model, cache_salt="s1"), "glm-5.2", ns, 64)
    assert front.parsed.body["messages"] is front.validated().body["messages"]  # one object, rebuilt once
    hasher = front.hasher(never)
    parsed = front.validated()
    assert hasher("chat/completions", parsed.body, "glm-5.2", ns, 64) == front.hashed.hashes
    alias_defaults = {**parsed.body, "max_tokens": 9}  # a new dict, the same prompt objects
    assert hasher("chat/completions", alias_defaults, "glm-5.2", ns, 64) == front.hashed.hashes


def test_the_hashes_are_used_only_for_what_they_were_computed_from():
    front = prepare(chat(), "chat/completions", Hashing(NAMES, 64))
    body = front.validated().body
    calls = []

    def fallback(*args: object) -> list[int]:
        calls.append(args)
        return [1]

    hasher = front.hasher(fallback)
    assert hasher("chat/completions", body, "glm-5.2", "other", 64) == [1]  # another namespace
    assert hasher("chat/completions", body, "other-model", "tenant:a", 64) == [1]
    assert hasher("chat/completions", body, "glm-5.2", "tenant:a", 128) == [1]  # another chunk size
    assert hasher("chat/completions", {**body, "messages": list(body["messages"])}, "glm-5.2", "tenant:a", 64) == [1]
    assert len(calls) == 4
    assert hasher("chat/completions", body, "glm-5.2", "tenant:a", 64) == front.hashed.hashes


def test_an_invalid_body_carries_its_error_and_no_hashes():
    front = prepare(chat(temperature=5), "chat/completions", Hashing(NAMES, 64))
    back = pickle.loads(pickle.dumps(front))
    with pytest.raises(InvalidRequest) as raised:
        back.validated()
    with pytest.raises(InvalidRequest) as inline:
        validate(chat(temperature=5), "chat/completions")
    assert raised.value.body() == inline.value.body() and back.hashed is None
    assert back.model == "glm-5.2" and back.stream is False


def test_no_hashing_asked_none_computed_and_a_name_not_the_tenants_none_either():
    assert prepare(chat(), "chat/completions", None).hashed is None
    assert prepare(chat("gpt-4o"), "chat/completions", Hashing(NAMES, 64)).hashed is None
    assert prepare(chat(), "chat/completions", Hashing(NAMES, 64)).image_at is None
    img = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert prepare(img, "chat/completions", None).image_at == "messages[0].content[0]"

