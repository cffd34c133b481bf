"""The gateway's KV-event consumer (gateway/kvevents) without sockets: both wire encodings, the consumer's own
chained keys, the per-rank block view, the request hasher, the precise index's per-replica fallback, the routing
mode's config, the virtual-clock fleet's modes, the subscription's sequence rules and the descriptor's endpoints
(docs/kv-events.md). Over real ZMQ and HTTP: test_kv_events.py; the simulator's publisher: tests/sim/."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from gateway.config import ConfigError, Routing, parse_config
from gateway.kvevents import keys
from gateway.kvevents.blocks import RankBlocks
from gateway.kvevents.index import PreciseIndex
from gateway.kvevents.request_keys import TokenPrefixHasher
from gateway.kvevents.wire import Cleared, Removed, Stored, WireError, decode_batch
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.tokenizers.sim import SimRuleTokenizer
from gateway_lab.sim.kv_events import encode_batch


# -- wire ---------------------------------------------------------------------------------------------------------
def test_decode_both_encodings_ignoring_unknowns() -> None:
    arrays = msgspec.msgpack.encode([1.5, [["BlockStored", [1, 2], None, [7] * 8, 4, None, "GPU", "future"],
                                           ["BlockRemoved", [1]], ["Unknown", 3], ["AllBlocksCleared"]]])
    b = decode_batch(arrays)
    assert b.rank is None and not b.maps
    assert b.events == [Stored([1, 2], None, [7] * 8, 4), Removed([1]), Cleared()]
    maps = msgspec.msgpack.encode([2.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4,
                                          "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
                                          "cache_salt": "s", "session_id": "x", "brand_new": 1},
                                         {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
                                         {"type": "SomethingElse"}, {"type": "AllBlocksCleared"}], 3])
    b = decode_batch(maps)
    assert b.rank == 3 and b.maps
    assert b.events == [Stored([5], 4, [1, 2, 3, 4], 4, "s"), Removed([5]), Cleared()]
    # the simulator's encoder round-trips through the decoder
    assert decode_batch(encode_batch(1.0, [["AllBlocksCleared"]], None, maps=False)).events == [Cleared()]
    for bad in (b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0])):
        with pytest.raises(WireError):
            decode_batch(bad)


# -- the consumer's view ------------------------------------------------------------------------------------------
def test_event_keys_equal_request_keys() -> None:
    tokens = list(range(1000, 1000 + 64))
    blocks = RankBlocks()
    blocks.apply([Stored([11, 12], None, tokens[:32], 16, "t"), Stored([13, 14], 12, tokens[32:], 16, "t")])
    request = keys.chain(keys.seed("t"), np.asarray(tokens), 16)
    assert len(request) == 4 and all(k in blocks.held for k in request)
    assert not any(k in blocks.held for k in keys.chain(keys.seed("other"), np.asarray(tokens), 16))


def test_unknown_parent_starts_a_chain_that_never_matches_from_the_root() -> None:
    blocks = RankBlocks()
    tokens = list(range(32))
    blocks.apply([Stored([21, 22], 999, tokens, 16)])
    assert blocks.orphans == 1 and len(blocks) == 2
    assert not any(k in blocks.held for k in keys.chain(keys.seed(None), np.asarray(tokens), 16))
    blocks.apply([Removed([21, 22, 12345])])  # removals resolve through the engine-hash map; unknown ones are ignored
    assert len(blocks) == 0 and not blocks.by_engine


def test_malformed_store_and_clear() -> None:
    blocks = RankBlocks()
    blocks.apply([Stored([1, 2], None, [1] * 20, 16)])  # 2 pages need 32 tokens
    assert blocks.malformed == 1 and len(blocks) == 0
    blocks.apply([Stored([1], None, [1] * 15 + ["x"], 16), Stored([1], None, [-1] * 16, 16)])  # not uint32 ids
    assert blocks.malformed == 3 and len(blocks) == 0
    applied = blocks.apply([Stored([1], None, [1] * 16, 16), Cleared()])
    assert len(blocks) == 0 and applied.cleared


def test_request_hasher_samples_one_key_per_chunk() -> None:
    h = TokenPrefixHasher(SimRuleTokenizer(), block_size=64)
    body = {"messages": [{"role": "user", "content": "x" * 4096}]}
    out = h("chat/completions", body, "m", "ns", chunk_tokens=256)
    ids = SimRuleTokenizer().encode_request("chat/completions", body)
    pages = keys.chain(keys.seed("ns"), ids, 64)
    assert out == pages[3::4] and len(out) == len(ids) // 256
    assert h("completions", {"prompt": list(range(600))}, "m", "", 256) == \
        keys.chain(keys.seed(""), np.arange(600), 64)[3::4]


def test_lora_adapter_is_part_of_the_namespace() -> None:
    """0.5.23 names a LoRA request's adapter on its BlockStored (`lora_name`); the request names it in `lora_path`.
    Pages of one adapter never match a request for another, or for the base model (SGLang's radix tree keys them
    apart: the adapter id ends the request's extra_key)."""
    maps = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                          "token_ids": list(range(512)), "block_size": 256, "lora_id": None,
                                          "medium": "GPU", "cache_salt": "t", "lora_name": "sql-expert"}], 0])
    [ev] = decode_batch(maps).events
    assert isinstance(ev, Stored) and ev.lora == "sql-expert" and ev.salt == "t"
    blocks = RankBlocks()
    blocks.apply([ev])
    h = TokenPrefixHasher(SimRuleTokenizer(), block_size=256)
    prompt = list(range(512))
    assert all(k in blocks.held for k in h("completions", {"prompt": prompt, "lora_path": "sql-expert"}, "m", "t"))
    assert not any(k in blocks.held for k in h("completions", {"prompt": prompt, "lora_path": "other"}, "m", "t"))
    assert not any(k in blocks.held for k in h("completions", {"prompt": prompt}, "m", "t"))
    assert keys.namespace("t") == "t" and keys.namespace(None, "a") != keys.namespace("a")


def test_unnamespaced_events_match_a_salted_request_through_its_plain_keys() -> None:
    """<= 0.5.13 publishes neither cache_salt nor the adapter: a rank on that encoding is looked up with the
    request's plain chain (computed once such an engine has been seen)."""
    h = TokenPrefixHasher(SimRuleTokenizer(), block_size=16)
    body = {"prompt": list(range(64))}
    blocks = RankBlocks()
    blocks.apply([Stored([1, 2, 3, 4], None, list(range(64)), 16)])  # an arrays event: no salt
    named = h("completions", body, "m", "tenant:a", chunk_tokens=32)
    assert not h.plain_of  # no plain engine seen yet: no second chain
    h.plain_needed = True
    assert h("completions", body, "m", "tenant:a", chunk_tokens=32) == named
    assert [h.plain_of[k] for k in named] == keys.chain(keys.seed(None), np.arange(64), 16)[1::2]
    plain, salted = _Rank(blocks.held, plain=True), _Rank(blocks.held)
    idx = PreciseIndex(MemoryPrefixIndex(), "precise", {"a@1": [plain], "b@1": [salted]}.get, dispatch_ttl_s=10,
                       lag_ttl_s=2, plain_of=h.plain_of)
    assert asyncio.run(idx.match(named, ["a@1", "b@1"])) == {"a@1": 2}


class _Rank:
    def __init__(self, held: set[int], healthy: bool = True, plain: bool = False) -> None:
        self.blocks = RankBlocks(held=held)
        self.healthy = healthy
        self.plain = plain


def test_precise_index_answers_from_events_and_falls_back_per_replica() -> None:
    async def run() -> None:
        inner = MemoryPrefixIndex()
        await inner.insert("a@1", [1, 2, 3], 900)  # the approximate index believes a holds 3 chunks
        await inner.insert("b@1", [1, 2, 3], 900)
        ranks = {"a@1": [_Rank({1})], "b@1": [_Rank({1}, healthy=False)]}
        idx = PreciseIndex(inner, "precise", ranks.get, dispatch_ttl_s=10, lag_ttl_s=2)
        # a: the events say 1 chunk (evicted since); b: its subscription is unhealthy -> the approximate answer
        assert await idx.match([1, 2, 3], ["a@1", "b@1", "c@1"]) == {"a@1": 1, "b@1": 3}
        assert idx.answers == {"events": 1, "fallback": 2}
        hybrid = PreciseIndex(inner, "hybrid", ranks.get, dispatch_ttl_s=10, lag_ttl_s=2)
        assert (await hybrid.match([1, 2, 3], ["a@1"]))["a@1"] == 3
        # a dispatch's speculative entry covers the event lag in precise mode
        await idx.insert("a@1", [1, 2, 3, 4], 10)
        assert (await idx.match([1, 2, 3, 4], ["a@1"]))["a@1"] == 4
        await idx.invalidate("a@1", [2, 3, 4])
        assert (await idx.match([1, 2, 3, 4], ["a@1"]))["a@1"] == 1

    asyncio.run(run())


def test_speculative_entry_after_first_token_is_short() -> None:
    now = [0.0]
    inner = MemoryPrefixIndex(clock=lambda: now[0])
    idx = PreciseIndex(inner, "precise", {"a@1": [_Rank(set())]}.get, dispatch_ttl_s=10, lag_ttl_s=2,
                       clock=lambda: now[0])

    async def run() -> None:
        await idx.insert("a@1", [1, 2], 900)  # the first token's residency entry: only the event lag is covered
        now[0] = 1.0
        assert (await idx.match([1, 2], ["a@1"])) == {"a@1": 2}
        now[0] = 3.0
        assert (await idx.match([1, 2], ["a@1"])) == {}

    asyncio.run(run())


def test_routing_mode_config() -> None:
    assert Routing().mode == "approximate"
    with pytest.raises(ValueError, match=r"multiple of kv_events\.block_size"):
        Routing(mode="precise", chunk_tokens=96)
    with pytest.raises(ValueError, match="path: required"):
        Routing(mode="precise", kv_events={"tokenizer": {"kind": "hf"}})
    with pytest.raises(ValueError):
        Routing(mode="hybrid", kv_events={"static": {"r0": {"endpoint": "tcp://h"}}})
    r = Routing(mode="hybrid", kv_events={"static": {"r0": {"endpoint": "tcp://h:5557", "dp_size": 2}}})
    assert r.kv_events.static["r0"].dp_size == 2
    with pytest.raises((ConfigError, ValueError)):
        parse_config({"models": [], "routing": {"mode": "exact"}})


# -- the virtual-clock fleet (gateway replay --modes) ------------------------------------------------------------
def _fleet_job(mode: str) -> tuple[object, object, object]:
    from gateway.routing.request import RoutingRequest
    from gateway_lab.replay.kv_modes import install
    from gateway_lab.sim.fleet import Fleet, Job, mi355x_targets

    routing = Routing(mode=mode)
    fleet = Fleet(mi355x_targets(2), routing)
    install(fleet, routing, page_size=64)
    pages = list(range(1000, 1000 + 16))  # 16 pages of 64 = 4 chunks of 256
    hashes = (11, 12, 13, 14)
    job = Job(RoutingRequest("r", "t", "m", "chat/completions", True, 1024, 8, hashes), pages, 1024, 8)
    return fleet, job, pages


@pytest.mark.parametrize("mode", ["precise", "hybrid"])
def test_fleet_modes_read_the_engine_cache(mode: str) -> None:
    fleet, job, pages = _fleet_job(mode)
    a = fleet.infos[0]  # type: ignore[attr-defined]
    fleet.warm(a.name, pages, job.req.hashes)  # type: ignore[attr-defined]  # cached there, and indexed
    inst = fleet.instances[0]  # type: ignore[attr-defined]
    fleet.on_job(job)  # type: ignore[attr-defined]
    assert inst.index.match_sync(job.req.hashes, [a.key]) == {a.key: 4}  # type: ignore[attr-defined]
    cache = fleet.ranks[a.name].rank.cache  # type: ignore[attr-defined]
    cache.evict(8 * 64)  # the engine drops the last 8 pages (2 chunks), leaves first
    fleet.loop.now = 10.0  # type: ignore[attr-defined]  # past the speculative window of the warm-up's entry
    # both read the engine's cache; hybrid also saw the evictions reach its approximate index
    assert inst.index.match_sync(job.req.hashes, [a.key]) == {a.key: 2}  # type: ignore[attr-defined]
    assert inst.index.inner.match_sync(job.req.hashes, [a.key]) == {a.key: 2 if mode == "hybrid" else 4}  # type: ignore[attr-defined]


def test_fleet_approximate_is_untouched() -> None:
    fleet, job, pages = _fleet_job("approximate")
    assert fleet.on_job is None  # type: ignore[attr-defined]
    a = fleet.infos[0]  # type: ignore[attr-defined]
    fleet.warm(a.name, pages, job.req.hashes)  # type: ignore[attr-defined]
    fleet.ranks[a.name].rank.cache.evict(8 * 64)  # type: ignore[attr-defined]
    assert fleet.instances[0].index.match_sync(job.req.hashes, [a.key]) == {a.key: 4}  # type: ignore[attr-defined]


def test_subscription_sequence_rules_without_a_socket() -> None:
    from gateway.kvevents.subscriber import Subscription

    applied: list[int] = []
    resets: list[str] = []
    sub = Subscription(None, "tcp://h:1", None, "", on_batch=lambda b: applied.append(int(b.ts)),  # type: ignore[arg-type]
                       on_reset=resets.append)
    sub._first_after_connect = False

    def msg(seq: int) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([float(seq), [["AllBlocksCleared"]]])]

    for seq in (0, 1, 1, 2):  # in order, a duplicate skipped
        sub._receive(msg(seq))
    assert applied == [0, 1, 2] and not resets
    sub._receive(msg(0))  # the sequence restarted: the engine restarted
    assert resets == ["restart"] and applied[-1] == 0 and sub.stats.resets == 1
    sub._receive(msg(5))  # a gap: held until the replay resolves it
    assert sub.resyncing and sub._pending_gap is not None and sub.stats.gaps == 1 and not sub.healthy
    asyncio.run(sub._resolve_gap())  # no replay socket: the rank's view is dropped, the batch applied
    assert resets == ["restart", "gap"] and applied[-1] == 5 and not sub.resyncing
    sub._receive([b"", b"\x00"])  # not three frames with an 8-byte sequence
    assert sub.stats.bad_payloads == 1


def test_descriptor_endpoints_dial_the_replica_host_for_a_wildcard() -> None:
    from gateway.kvevents.manager import endpoints_from_descriptor

    d = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "", "block_size": 64,
         "dp_size": 2, "replay_endpoint_port_base": 5600}
    ep = endpoints_from_descriptor(d, "http://10.1.2.3:30000")
    assert ep is not None and (ep.pub(0), ep.pub(1), ep.replay(1)) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558",
                                                                       "tcp://10.1.2.3:5601")
    assert endpoints_from_descriptor({**d, "endpoint_host": "engine-0"}, "http://10.1.2.3:30000").pub(0) == \
        "tcp://engine-0:5557"  # type: ignore[union-attr]
    no_replay = endpoints_from_descriptor({k: v for k, v in d.items() if k != "replay_endpoint_port_base"}, "http://h:1")
    assert no_replay is not None and no_replay.replay(0) is None
    for bad in ({**d, "publisher": "null"}, {**d, "endpoint_port_base": "5557"}, {}):
        assert endpoints_from_descriptor(bad, "http://h:1") is None


def test_precise_asks_the_approximate_index_only_for_replicas_that_fall_back() -> None:
    class Counting(MemoryPrefixIndex):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[list[str]] = []

        async def match(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
            self.asked.append(list(replicas))
            return await super().match(hashes, replicas)

    async def run() -> None:
        inner = Counting()
        ranks = {"a@1": [_Rank({1})], "b@1": [_Rank({1})]}
        idx = PreciseIndex(inner, "precise", ranks.get, dispatch_ttl_s=10, lag_ttl_s=2)
        assert await idx.match([1], ["a@1", "b@1"]) == {"a@1": 1, "b@1": 1}
        assert inner.asked == []  # every replica answered from its events: no Redis round trip
        ranks["b@1"][0].healthy = False
        await idx.match([1], ["a@1", "b@1"])
        assert inner.asked == [["b@1"]]
        hybrid = PreciseIndex(inner, "hybrid", ranks.get, dispatch_ttl_s=10, lag_ttl_s=2)
        await hybrid.match([1], ["a@1", "b@1"])
        assert inner.asked[-1] == ["a@1", "b@1"]

    asyncio.run(run())
