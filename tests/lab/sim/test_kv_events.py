"""KV events as the simulator publishes them (gateway_lab/sim/kv_events.py over the radix cache): the engine's hashing
(real SGLang's test vector), salts, 0.5.23's coalesced chains against 0.5.13's per-page events, parent links,
re-stores, and the descriptor/config. The gateway's consumer of these events is tested in tests/kvevents/."""

from __future__ import annotations

import numpy as np
import pytest

from gateway_lab.sim.kv_events import KvEventsConfig, RankEvents, descriptor
from gateway_lab.sim.radix_cache import PrefixCache

# shared/reference/real-sglang.md B.1 (g): tokens 100..131 at page 16, as SGLang 0.5.x publishes them
SGLANG_VECTOR = [3783480490812179100, -5523102609743566000]
SGLANG_VECTOR_SALTED = [-2859216288755805700, -5074412400272423067]  # cache_salt "tenantA", 0.5.23 default format


def _cache(maps: bool, page: int = 16) -> tuple[PrefixCache, RankEvents]:
    cache = PrefixCache(page)
    ev = RankEvents(page, maps)
    cache.events = ev
    return cache, ev


def _store(cache: PrefixCache, tokens: list[int], namespace: str = "\x00") -> list[int]:
    k = cache.page_keys(np.asarray(tokens, dtype=np.uint32), namespace)
    cache.insert(k, 0.0)
    return k


@pytest.mark.parametrize("maps", [False, True])
def test_simulator_hashes_match_sglang_test_vector(maps: bool) -> None:
    cache, ev = _cache(maps)
    _store(cache, list(range(100, 132)))
    events = ev.take()
    hashes = events[0]["block_hashes"] if maps else [h for e in events for h in e[1]]
    assert hashes == SGLANG_VECTOR


def test_salted_hashes_on_0523_and_ignored_before() -> None:
    for maps, want in ((True, SGLANG_VECTOR_SALTED), (False, SGLANG_VECTOR)):
        cache, ev = _cache(maps)
        _store(cache, list(range(100, 132)), "tenantA\x00")
        events = ev.take()
        if maps:
            [payload] = events
            assert payload["block_hashes"] == want and payload["cache_salt"] == "tenantA"
        else:  # 0.5.9/0.5.13: the salt is neither hashed nor on the wire; one event per page
            assert [h for e in events for h in e[1]] == want and all(len(e) == 7 for e in events)


def test_0523_coalesces_a_chain_and_removals_0513_does_not() -> None:
    for maps in (True, False):
        cache, ev = _cache(maps, page=4)
        _store(cache, list(range(8)))
        _store(cache, list(range(16)))  # extends the first chain: one event on 0.5.23
        events = ev.take()
        assert len(events) == (1 if maps else 4)  # 0.5.13: one BlockStored per page, as its mem_cache/events.py
        cache.evict(16)
        removed = ev.take()
        assert len(removed) == (1 if maps else 4)
        cache.flush()
        assert ev.take() == [{"type": "AllBlocksCleared"} if maps else ["AllBlocksCleared"]]


def test_child_parent_links_to_the_parent_page_hash() -> None:
    cache, ev = _cache(False, page=4)
    _store(cache, list(range(8)))
    first = ev.take()
    assert first[1][2] == first[0][1][0] and first[1][3] == [4, 5, 6, 7]  # each page under the one before
    _store(cache, list(range(12)))
    second = ev.take()[0]
    assert second[2] == first[-1][1][-1] and second[3] == [8, 9, 10, 11]


def test_a_page_stored_again_after_eviction_is_reported_again() -> None:
    """Two queued requests key the same prompt; the first stores it, it is evicted, the second stores it again: the
    engine reports the second store too (a silent one left the consumer blind to what the engine held)."""
    cache, ev = _cache(False, page=4)
    toks = np.arange(12, dtype=np.uint32)
    second = cache.page_keys(toks, "\x00")
    _store(cache, toks.tolist())
    stored = ev.take()
    cache.evict(12)
    ev.take()
    cache.insert(second, 1.0)
    again = ev.take()
    assert [e[1] for e in again] == [e[1] for e in stored] and [e[3] for e in again] == [e[3] for e in stored]


def test_descriptor_and_config_parse() -> None:
    cfg = KvEventsConfig.parse('{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}')
    assert cfg is not None
    assert descriptor(cfg, 64, 2) == {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
                                      "block_size": 64, "dp_size": 2, "replay_endpoint_port_base": 5558}
    # 0.5.13's descriptor names no replay port, though its publisher binds one
    assert "replay_endpoint_port_base" not in descriptor(cfg, 1, 1, replay=False)
    assert KvEventsConfig.parse('{"publisher":"null"}') is None
    for bad in ('{"publisher":"kafka"}', '{"publisher":"zmq","endpoint":"ipc:///x"}', '{"nope":1}', "[1]"):
        with pytest.raises(ValueError):
            KvEventsConfig.parse(bad)


def test_one_token_pages_are_published_one_event_each() -> None:
    """0.5.13 on the CPU serves with 1-token pages: every token is a page, and its event names the page before it."""
    cache, ev = _cache(False, page=1)
    _store(cache, [7, 8, 9])
    events = ev.take()
    assert [e[3] for e in events] == [[7], [8], [9]] and [e[4] for e in events] == [1, 1, 1]
    assert events[0][2] is None and events[1][2] == events[0][1][0] and events[2][2] == events[1][1][0]
