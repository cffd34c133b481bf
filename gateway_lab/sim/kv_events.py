"""KV-cache events as SGLang publishes them with `--kv-events-config` (shared/reference/real-sglang.md, B.1).

One publisher per DP rank (each rank is an independent radix cache):
- a ZMQ PUB bound on the endpoint's port + rank, sending `[topic, seq as 8-byte big-endian, msgpack batch]`, the batch
  `[ts, events, attn_dp_rank]`; `seq` starts at 0 in every process (so a restart resets it) and counts batches;
- an optional replay ROUTER on replay_endpoint's port + rank: `[identity, b"", start_seq]` is answered with every
  buffered batch from `start_seq` (0.5.23: `[id, b"", topic, seq, payload]`; 0.5.9/0.5.13: `[id, b"", seq, payload]`),
  then the end marker (seq -1); the buffer keeps the last `buffer_steps` batches.
Encodings by `--sglang-version`: 0.5.9/0.5.13 tagged arrays (`["BlockStored", hashes, parent, tokens, block_size,
lora_id, medium]`), unsalted hashes, one BlockStored per page (each under the page before it, as 0.5.13's
mem_cache/events.py sends them) and one BlockRemoved per page, the batch array without a None rank; 0.5.23 tagged
maps, salted chains (`cache_salt` on the event), consecutive stores of one chain and consecutive removals coalesced. The rank's queue is published every `PUBLISH_EVERY_S` (SGLang publishes from its scheduler loop).

Test switches (not SGLang's): `port_collision` reproduces the pre-0.5.23 plain-DP bug (every rank binds port + 0,
so only rank 0 publishes; the others log the bind error); `drop_next(n)` sends nothing for the next n batches of each
rank (they still take a sequence number and stay in the replay buffer), as a subscriber that missed them would see.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway_lab.sim.radix_cache import Node

log = logging.getLogger("gateway_lab.sim.kv_events")

PUBLISH_EVERY_S = 0.005
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SALT_TAG = b"sglang-cache-salt-v1\0"


@dataclass(frozen=True)
class KvEventsConfig:
    """SGLang's KVEventsConfig fields (the ones that change what is published)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, raw: str | dict[str, Any] | None) -> KvEventsConfig | None:
        """The `--kv-events-config` JSON; None when absent or the null publisher. Raises ValueError when invalid."""
        if raw is None or raw == "":
            return None
        try:
            data = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config: expected a JSON object")  # noqa: TRY004 (callers catch ValueError)
        known = {"publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "topic", "bind", "format",
                 "max_queue_size"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
        cfg = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r}")
        if cfg.publisher == "null":
            return None
        for ep in (cfg.endpoint, cfg.replay_endpoint):
            if ep is not None and port_of(ep) is None:
                raise ValueError(f"--kv-events-config: {ep!r} is not tcp://host:port")
        if cfg.buffer_steps < 1:
            raise ValueError("--kv-events-config: buffer_steps must be >= 1")
        return cfg


def port_of(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return None


def offset_endpoint(endpoint: str, rank: int) -> str:
    """SGLang's `offset_endpoint_port`: the port + rank for tcp."""
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def bind_host(endpoint: str) -> str:
    return endpoint[6:].rsplit(":", 1)[0]


def descriptor(cfg: KvEventsConfig, page_size: int, dp_size: int, replay: bool = True) -> dict[str, Any]:
    """`/server_info.kv_events` (0.5.13+). `replay`: it names the replay port (0.5.23); 0.5.13's descriptor
    (ServerArgs.kv_events_descriptor) has no `replay_endpoint_port_base`, though its publisher binds one."""
    out: dict[str, Any] = {"publisher": "zmq", "endpoint_host": bind_host(cfg.endpoint),
                           "endpoint_port_base": port_of(cfg.endpoint), "topic": cfg.topic, "block_size": page_size,
                           "dp_size": dp_size}
    if cfg.replay_endpoint and replay:
        out["replay_endpoint_port_base"] = port_of(cfg.replay_endpoint)
    return out


# -- encodings --------------------------------------------------------------------------------------------------
@dataclass
class _Stored:
    hashes: list[int]
    parent: int | None
    tokens: list[int]
    block_size: int
    salt: str | None


@dataclass
class _Removed:
    hashes: list[int]


class _Cleared:
    pass


def encode_event(ev: _Stored | _Removed | _Cleared, maps: bool) -> Any:
    if maps:  # 0.5.23: tagged maps, None fields omitted
        if isinstance(ev, _Stored):
            d: dict[str, Any] = {"type": "BlockStored", "block_hashes": ev.hashes, "parent_block_hash": ev.parent,
                                 "token_ids": ev.tokens, "block_size": ev.block_size, "lora_id": None, "medium": "GPU"}
            if ev.salt is not None:
                d["cache_salt"] = ev.salt
            return d
        if isinstance(ev, _Removed):
            return {"type": "BlockRemoved", "block_hashes": ev.hashes, "medium": "GPU"}
        return {"type": "AllBlocksCleared"}
    if isinstance(ev, _Stored):  # 0.5.9/0.5.13: tagged arrays (required fields always present, even when None)
        return ["BlockStored", ev.hashes, ev.parent, ev.tokens, ev.block_size, None, "GPU"]
    if isinstance(ev, _Removed):
        return ["BlockRemoved", ev.hashes, "GPU"]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[Any], rank: int | None, maps: bool) -> bytes:
    if maps:
        return msgspec.msgpack.encode([ts, list(events), rank])
    # 0.5.13's EventBatch has omit_defaults: a None rank is left out of the array
    return msgspec.msgpack.encode([ts, list(events)] if rank is None else [ts, list(events), rank])


# -- one rank ---------------------------------------------------------------------------------------------------
@dataclass
class RankEvents:
    """The CacheEvents sink of one rank's PrefixCache: queues events in the version's shape."""

    page_size: int
    maps: bool  # 0.5.23 encoding (tagged maps, salted hashes, coalescing)
    queue: list[_Stored | _Removed | _Cleared] = field(default_factory=list)

    def root_digest(self, salt: str | None) -> bytes:
        if self.maps and salt:
            return hashlib.sha256(_SALT_TAG + salt.encode()).digest()
        return b""  # unsalted: the first page hashes its tokens alone (0.5.9/0.5.13 ignore cache_salt)

    def stored(self, nodes: Sequence[Node], parent: Node | None, tokens: bytes, salt: str | None) -> None:
        ids = list(memoryview(tokens).cast("I")) if tokens else []
        ev = _Stored([n.event_hash for n in nodes], parent.event_hash if parent is not None else None, ids,
                     self.page_size, salt if self.maps else None)
        if not self.maps:  # 0.5.9/0.5.13: one BlockStored per page, each under the page before it
            bs = self.page_size
            for i, h in enumerate(ev.hashes):
                self.queue.append(_Stored([h], ev.parent if i == 0 else ev.hashes[i - 1], ids[i * bs:(i + 1) * bs],
                                          bs, None))
            return
        tail = self.queue[-1] if self.queue else None
        if isinstance(tail, _Stored) and tail.hashes and ev.parent == tail.hashes[-1] \
                and tail.salt == ev.salt:
            tail.hashes.extend(ev.hashes)
            tail.tokens.extend(ev.tokens)
            return
        self.queue.append(ev)

    def removed(self, node: Node) -> None:
        tail = self.queue[-1] if self.queue else None
        if self.maps and isinstance(tail, _Removed):
            tail.hashes.append(node.event_hash)
            return
        self.queue.append(_Removed([node.event_hash]))

    def cleared(self) -> None:
        self.queue.append(_Cleared())

    def take(self) -> list[Any]:
        out, self.queue = self.queue, []
        return [encode_event(e, self.maps) for e in out]


class RankPublisher:
    def __init__(self, ctx: zmq.asyncio.Context, cfg: KvEventsConfig, rank: int, port_rank: int, maps: bool,
                 page_size: int, attn_dp_rank: int | None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.maps = maps
        self.attn_dp_rank = attn_dp_rank
        self.events = RankEvents(page_size, maps)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.drop = 0
        self.topic = cfg.topic.encode()
        self.pub: zmq.asyncio.Socket | None = None
        self.replay: zmq.asyncio.Socket | None = None
        self.error: str | None = None
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        endpoint = offset_endpoint(cfg.endpoint, port_rank)
        try:
            pub.bind(endpoint)
        except zmq.ZMQError as e:  # SGLang logs this and the rank publishes nothing (the pre-fix DP collision)
            self.error = f"bind {endpoint}: {e}"
            log.error("KV event publisher of dp rank %d: %s", rank, self.error)
            pub.close(0)
            return
        self.pub = pub
        if cfg.replay_endpoint:
            rep = ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(offset_endpoint(cfg.replay_endpoint, port_rank))
            self.replay = rep

    def publish(self) -> None:
        if not self.events.queue:
            return
        events = self.events.take()
        if self.pub is None:
            return
        payload = encode_batch(time.time(), events, self.attn_dp_rank, self.maps)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop > 0:
            self.drop -= 1
            return
        try:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # past the high-water mark PUB drops, as SGLang's does

    async def serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) < 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    body = [self.topic, seq.to_bytes(8, "big"), payload] if self.maps else [seq.to_bytes(8, "big"), payload]
                    await self.replay.send_multipart([ident, b"", *body])
            end = [b"", END_SEQ, b""] if self.maps else [END_SEQ, b""]
            await self.replay.send_multipart([ident, b"", *end])

    def close(self) -> None:
        for s in (self.pub, self.replay):
            if s is not None:
                s.close(0)


class KvEventPublisher:
    """All ranks of one simulated server; attach before the first request, close on stop (and restart)."""

    def __init__(self, cfg: KvEventsConfig, caches: Sequence[Any], *, maps: bool, page_size: int,
                 dp_attention: bool, port_collision: bool) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ranks: list[RankPublisher] = []
        for i, cache in enumerate(caches):
            port_rank = 0 if port_collision else i
            # the batch's attn_dp_rank: under plain DP before 0.5.23 every rank says 0 (the collision's cause)
            attn = i if (dp_attention or maps) else 0
            rp = RankPublisher(self.ctx, cfg, i, port_rank, maps, page_size, attn)
            cache.events = rp.events
            self.ranks.append(rp)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._loop()))
        for rp in self.ranks:
            if rp.replay is not None:
                self._tasks.append(loop.create_task(rp.serve_replay()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_EVERY_S)
            for rp in self.ranks:
                rp.publish()

    def drop_next(self, n: int) -> None:
        for rp in self.ranks:
            rp.drop += n

    def state(self) -> list[dict[str, Any]]:
        return [{"dp_rank": rp.rank, "seq": rp.seq, "buffered": len(rp.buffer), "dropping": rp.drop,
                 "error": rp.error} for rp in self.ranks]

    async def close(self) -> None:
        for rp in self.ranks:
            rp.publish()  # what is queued goes out before the sockets close
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # cancelled: shutting down
        for rp in self.ranks:
            rp.close()
        self.ctx.term()
