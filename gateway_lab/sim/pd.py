"""SGLang's prefill/decode disaggregation in the simulator: the two server roles and the KV transfer between them.

SGLang (`--disaggregation-mode prefill|decode`): a PD router sends the same request to a prefill server and a decode
server at once, both carrying `bootstrap_host`, `bootstrap_port` (the prefill server's bootstrap server) and a random
`bootstrap_room`. Each server puts it on DP rank `bootstrap_room % dp_size` unless the router pinned one. The
prefill server computes the prompt (its radix cache applies), then sends the room's KV to the decode server, which
has reserved KV for the prompt and the output and waits for it; the prefill server answers its request (one token)
once the transfer is done and frees its KV. The decode server then runs the request in its decode batch and
streams the answer to the router, which relays it to the client.

Here the two sides meet in a `KvFabric` (one per process): the prefill side registers its bootstrap address, each
side registers its half of a room, and the transfer starts when the prompt is computed *and* the decode side holds
its reservation; it takes `ReplicaConfig.kv_transfer_time(prompt tokens)` (the link model). Failures: either side's
request going away (client gone, server restart, abort) before the transfer is done fails the other side's request
with SGLang's errors; a decode request whose KV has not arrived after `disaggregation_waiting_timeout` fails, and so
does a prefill request whose decode never showed up after `disaggregation_bootstrap_timeout`.

The ranks are clock-free (like `engine.Rank`); whoever drives them (real time: `replica.py`; virtual time:
`gateway_lab/replay/pd.py`) passes a `Side` (how to kick the rank, read its clock) and the fabric a `later`
function (run a callback after some simulated seconds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import ReplicaConfig
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest, Step

Later = Callable[[float, Callable[[], None]], Any]


class PrefillRank(Rank):
    """A prefill-mode rank: every request generates its first token only; its KV stays held (and counted in
    `used_tokens`) until the fabric says the transfer is done or failed."""

    def __init__(self, cfg: ReplicaConfig, dp_rank: int = 0, seed: int = 0) -> None:
        super().__init__(cfg, dp_rank, seed)
        self.sending: dict[SimRequest, Room] = {}  # prefilled, KV held until the transfer ends
        self.rooms: dict[SimRequest, Room] = {}

    def submit(self, req: SimRequest) -> None:
        room = self.rooms.get(req)
        if room is not None:  # the first token goes out with the prefill's answer, once the KV has been sent
            deliver = req.sink

            def hold(ev: Event, room: Room = room, deliver: Callable[[Event], None] = deliver) -> None:
                if ev.kind is EventKind.FIRST and room.state != "done":
                    room.held.append(ev)
                else:
                    deliver(ev)

            req.sink = hold
        super().submit(req)

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finished = True
        room = self.rooms.get(req)
        if room is None:  # not a PD request (a health probe): as a unified server
            self._release(req, now)
            req.sink(Event(EventKind.FINISH, now, reason=req.finish_reason))
            return
        self.sending[req] = room
        room.prefilled(now)

    def transfer_ended(self, req: SimRequest, now: float) -> None:
        """The room's KV was sent (or the transfer failed): free what the request holds."""
        self.sending.pop(req, None)
        self.rooms.pop(req, None)
        self._release(req, now)

    def abort(self, req: SimRequest, now: float) -> None:
        room = self.rooms.pop(req, None)
        if req in self.sending:
            self.sending.pop(req)
            self.counters.aborted += 1
            self._release(req, now)
        else:
            super().abort(req, now)
        if room is not None:
            room.side_gone("prefill", now)


class DecodeRank(Rank):
    """A decode-mode rank: a PD request first waits for a KV reservation (SGLang's prealloc queue), then for its
    room's KV (the transfer queue), then joins the decode batch as a prebuilt batch: its first token (computed by the
    prefill server, sent with the KV) goes out at once, the next ones from the decode steps."""

    def __init__(self, cfg: ReplicaConfig, dp_rank: int = 0, seed: int = 0) -> None:
        super().__init__(cfg, dp_rank, seed)
        self.prealloc: list[SimRequest] = []
        self.transferring: list[SimRequest] = []
        self.arrived: list[SimRequest] = []
        self.rooms: dict[SimRequest, Room] = {}

    def submit(self, req: SimRequest) -> None:
        if req not in self.rooms:  # no room: a health probe, or unified serving (disaggregation_decode_local_prefill)
            super().submit(req)
            return
        self.prealloc.append(req)
        self.counters.requests += 1
        self.counters.prompt_tokens += req.prompt_len

    def kv_arrived(self, req: SimRequest) -> None:
        if req in self.transferring:
            self.transferring.remove(req)
            self.arrived.append(req)

    def _allocate(self, now: float) -> None:
        cfg, cache = self.cfg, self.cache
        while self.prealloc:
            req = self.prealloc[0]
            need = req.prompt_len + req.output_len
            free = cfg.max_total_num_tokens - cache.total_tokens - self.reserved
            if need > free:
                if need > free + cache.evictable_tokens:
                    return  # FIFO, as SGLang's prealloc queue: wait for running requests to free KV
                cache.evict(need - free)
            self.prealloc.pop(0)
            req.started = True
            req.reserved = need
            self.reserved += need
            self.transferring.append(req)
            room = self.rooms.get(req)
            if room is not None:
                room.allocated(now)

    def plan(self, now: float) -> Step | None:
        if self.paused:
            return None
        self._allocate(now)
        room_left = self.cfg.max_running_requests - len(self.running)
        if self.arrived and room_left > 0:
            # SGLang's prebuilt batch: the first token came with the KV (the prefill's output id), so the requests
            # join the running batch with no model forward of their own
            return Step("prebuilt", 0.0, 0.0, picks=[(r, 0) for r in self.arrived[:room_left]])
        return super().plan(now)

    def complete(self, step: Step, now: float) -> None:
        if step.kind != "prebuilt":
            super().complete(step, now)
            return
        self.counters.busy_time += step.duration
        for req, _ in step.picks:
            if req in self.arrived:
                self.arrived.remove(req)
            if req.finished:
                continue
            self.rooms.pop(req, None)
            self._first_token(req, now)  # the first token came with the KV (SGLang's prebuilt batch)

    def abort(self, req: SimRequest, now: float) -> None:
        room = self.rooms.pop(req, None)
        for queue in (self.prealloc, self.transferring, self.arrived):
            if req in queue:
                queue.remove(req)
                req.finished = True
                self.counters.aborted += 1
                self._release(req, now)
                break
        else:
            super().abort(req, now)
        if room is not None:
            room.side_gone("decode", now)



def pd_queues(rank: Rank) -> dict[str, Any]:
    """A PD rank's queues as /v1/loads reports them (the `disagg` section)."""
    if isinstance(rank, DecodeRank):
        return {"mode": "decode", "num_prealloc_queue_reqs": len(rank.prealloc),
                "num_transfer_queue_reqs": len(rank.transferring), "num_prebuilt_reqs": len(rank.arrived)}
    if isinstance(rank, PrefillRank):
        return {"mode": "prefill", "num_inflight_transfer_reqs": len(rank.sending)}
    return {"mode": "null"}


def make_rank(cfg: ReplicaConfig, dp_rank: int = 0, seed: int = 0) -> Rank:
    """The rank class of the server's disaggregation mode."""
    cfg.check_disaggregation()
    cls = {"prefill": PrefillRank, "decode": DecodeRank}.get(cfg.disaggregation_mode, Rank)
    return cls(cfg, dp_rank, seed)


MAX_ROOM = (1 << 63) - 1


@dataclass(frozen=True)
class Bootstrap:
    """A request's PD fields: which prefill server's bootstrap port holds (or will hold) the room's KV."""

    host: str
    port: int
    room: int


def bootstrap_fields(body: dict[str, Any], cfg: ReplicaConfig) -> Bootstrap | None:
    """The bootstrap fields of a request to a PD server, validated (ValueError: a 400 to the caller). None: the
    request has none (refused by a PD server unless it is a decode server that also prefills locally)."""
    room = body.get("bootstrap_room")
    if room is None:
        if cfg.disaggregation_mode == "decode" and cfg.disaggregation_decode_local_prefill:
            return None
        # SGLang asserts here ("Do not send requests directly to prefill or decode instances"); a clear 400 instead
        raise ValueError(f"bootstrap_room is required by a {cfg.disaggregation_mode} server "
                         "(--disaggregation-mode): send requests through a PD router.")
    if isinstance(room, list) or isinstance(body.get("bootstrap_host"), list):
        raise ValueError("batched bootstrap fields (lists) are not served by the simulator: one sequence per request.")  # noqa: TRY004 (a 400 like the rest)
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be an integer in [0, 2^63), got {room!r}.")
    host = body.get("bootstrap_host")
    if not isinstance(host, str) or not host:
        raise ValueError("bootstrap_host must be a non-empty string.")
    port = body.get("bootstrap_port")
    if port is None:
        port = cfg.disaggregation_bootstrap_port  # a router that knows no port sends null: the default applies
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bootstrap_port must be a port number, got {port!r}.")
    return Bootstrap(host, port, room)


def rank_for_room(room: int, dp_size: int) -> int:
    """SGLang's DP dispatch in PD mode (follow_bootstrap_room): both sides agree on the rank without talking."""
    return room % dp_size


@dataclass
class Side:
    """One half of a room: the rank it waits on, how to wake that rank, its clock, and the request."""

    rank: PrefillRank | DecodeRank
    req: SimRequest
    kick: Callable[[], None]
    now: Callable[[], float]


@dataclass(eq=False)
class Room:
    """One bootstrap room: the prefill half and the decode half of one request, in either order."""

    fabric: KvFabric
    key: tuple[str, int]  # (bootstrap address, room)
    prefill: Side | None = None
    decode: Side | None = None
    prefilled_at: float | None = None
    reserved: bool = False
    state: str = "waiting"  # waiting | transferring | done | failed
    held: list[Event] = field(default_factory=list)  # the prefill side's first token, sent once the KV is out
    cfg: ReplicaConfig | None = None  # the prefill server's (its link model)
    stalled: bool = False  # fault: the transfer never completes (a wedged RDMA queue pair)

    # -- progress ---------------------------------------------------------------------------------------------
    def prefilled(self, now: float) -> None:
        self.prefilled_at = now
        self._maybe_start()

    def allocated(self, now: float) -> None:
        self.reserved = True
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.state != "waiting" or self.prefilled_at is None or not self.reserved:
            return
        assert self.prefill is not None and self.cfg is not None
        self.state = "transferring"
        if self.stalled:
            return  # only the waiting timeout ends it
        self.fabric.later(self.cfg.kv_transfer_time(self.prefill.req.prompt_len), self._done)

    def _done(self) -> None:
        if self.state != "transferring":
            return
        self.state = "done"
        self.fabric.rooms.pop(self.key, None)
        p, d = self.prefill, self.decode
        assert p is not None and d is not None
        assert isinstance(p.rank, PrefillRank) and isinstance(d.rank, DecodeRank)
        t = p.now()
        p.rank.transfer_ended(p.req, t)
        for ev in self.held:
            ev.time = max(ev.time, t)
            p.req.sink(ev)
        p.req.sink(Event(EventKind.FINISH, t, reason=p.req.finish_reason))
        p.kick()
        d.rank.kv_arrived(d.req)
        d.kick()
        self.fabric.transfers += 1

    # -- failures ---------------------------------------------------------------------------------------------
    def side_gone(self, which: str, now: float) -> None:
        """One side's request ended (aborted, cancelled, its server restarted) before the room was done."""
        self.fail(f"KV transfer failed for room {self.key[1]}: the {which} server dropped the request.", skip=which)

    def fail(self, message: str, skip: str | None = None) -> None:
        if self.state in ("done", "failed"):
            return
        self.state = "failed"
        self.fabric.rooms.pop(self.key, None)
        self.fabric.failures += 1
        for name, side in (("prefill", self.prefill), ("decode", self.decode)):
            if side is None or name == skip:
                continue
            t = side.now()
            side.rank.rooms.pop(side.req, None)  # no echo back into this room
            if isinstance(side.rank, PrefillRank) and side.req in side.rank.sending:
                side.rank.transfer_ended(side.req, t)
                side.rank.counters.aborted += 1
            else:
                side.rank.abort(side.req, t)
            side.req.sink(Event(EventKind.ABORT, t, reason=message, code=500))
            side.kick()

    def timeout(self, which: str, seconds: float) -> None:
        if self.state in ("done", "failed"):
            return
        if which == "decode":
            self.fail(f"KV transfer for room {self.key[1]} timed out: no KV after {seconds:g} s "
                      "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT).")
        elif self.decode is None:
            self.fail(f"Bootstrap for room {self.key[1]} timed out: no decode server after {seconds:g} s "
                      "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).")


class KvFabric:
    """Where the two halves of every room meet: bootstrap addresses of prefill servers, and open rooms."""

    def __init__(self, later: Later | None = None) -> None:
        self.later: Later = later or self._asyncio_later
        self.time_scale = 1.0  # real time: every simulated server of the process runs at the same scale
        self.servers: dict[str, Any] = {}  # "host:port" -> the prefill server's owner (its replica)
        self.rooms: dict[tuple[str, int], Room] = {}
        self.transfers = 0
        self.failures = 0
        self.stall_next = 0  # fault: the next N transfers never complete

    def register(self, address: str, owner: Any) -> None:
        self.servers[address] = owner

    def unregister(self, address: str, owner: Any) -> None:
        if self.servers.get(address) is owner:
            del self.servers[address]

    def _room(self, address: str, room: int) -> Room:
        key = (address, room)
        r = self.rooms.get(key)
        if r is None:
            r = self.rooms[key] = Room(self, key)
        return r

    def add_prefill(self, address: str, room: int, side: Side) -> Room:
        assert isinstance(side.rank, PrefillRank)
        r = self._room(address, room)
        r.prefill, r.cfg = side, side.rank.cfg
        if self.stall_next > 0:
            self.stall_next -= 1
            r.stalled = True
        side.rank.rooms[side.req] = r
        timeout = side.rank.cfg.disaggregation_bootstrap_timeout
        self.later(timeout, lambda: r.timeout("prefill", timeout))
        return r

    def add_decode(self, address: str, room: int, side: Side) -> Room:
        """The decode half; its rank holds the request from here on (prealloc, then transfer queue)."""
        assert isinstance(side.rank, DecodeRank)
        r = self._room(address, room)
        r.decode = side
        side.rank.rooms[side.req] = r  # its submit() then queues it for a KV reservation, not for prefill
        timeout = side.rank.cfg.disaggregation_waiting_timeout
        self.later(timeout, lambda: r.timeout("decode", timeout))
        if address not in self.servers:
            # SGLang's decode side cannot reach the bootstrap server: KVPoll.Failed, the request is aborted
            self.later(0.0, lambda: r.fail(f"KV transfer failed for room {room}: bootstrap server {address} is "
                                           "unreachable."))
        return r

    def _asyncio_later(self, delay: float, fn: Callable[[], None]) -> Any:
        """Real time: `delay` simulated seconds on the running loop, at the servers' time scale."""
        return asyncio.get_running_loop().call_later(max(0.0, delay) / self.time_scale, fn)


FABRIC = KvFabric()  # the process's fabric for `gateway sim`: every simulated server of one process shares it


def pd_room_hook(replica: Any, rank: Any, pd: Bootstrap) -> Callable[[SimRequest], None]:
    """For `Replica.submit`: register the request's half of its room before its rank sees it."""
    def hook(req: SimRequest) -> None:
        r = rank.rank
        assert isinstance(r, (PrefillRank, DecodeRank))
        side = Side(r, req, rank.kick, replica.now)
        if isinstance(r, PrefillRank):
            FABRIC.add_prefill(replica.bootstrap_address, pd.room, side)
        else:
            FABRIC.add_decode(str(pd.port), pd.room, side)

    return hook
