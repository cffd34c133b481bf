"""One simulated SGLang server: DP ranks on a shared clock, request submission, faults and restarts."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway_lab.sim.kv_events import KvEventPublisher, KvEventsConfig
from gateway_lab.sim.metrics import ReplicaMetrics
from gateway_lab.sim.pd import FABRIC, make_rank, pd_queues
from gateway_lab.sim.profiles import ReplicaConfig
from gateway_lab.sim.realtime import RealtimeRank, SimClock
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest


@dataclass
class Fault:
    """A one-shot (or `count`-shot) fault applied to the next matching requests."""

    kind: str  # reset_after_chunks | reset_before_headers | hang | hang_after_first | status
    n: int = 0
    status: int = 503
    count: int = 1


@dataclass(eq=False)
class Submission:
    """The requests behind one HTTP call (n choices), and the queue their events arrive on."""

    rank: RealtimeRank
    requests: list[SimRequest]
    queue: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)

    @property
    def cached(self) -> int:
        return self.requests[0].cached if self.requests else 0


class Replica:
    def __init__(self, cfg: ReplicaConfig, name: str = "sim") -> None:
        self.cfg = cfg
        self.name = name
        self.incarnation = uuid.uuid4().hex[:12]
        self.status = "ready"
        self.faults: list[Fault] = []
        self.metrics = ReplicaMetrics(self)
        self._rr = 0
        self._inflight: set[Submission] = set()
        # (start, end) on the host's monotonic clock of the last client requests, so a test can compute the exact
        # concurrency a fleet saw (CLOCK_MONOTONIC is shared by every process on the host) instead of polling for it
        self.spans: deque[tuple[float, float]] = deque(maxlen=4096)
        self._started: dict[int, float] = {}
        # the `priority` field of the last client requests as received (None: absent), so a test can read what a
        # gateway sent rather than what the scheduler made of it
        self.priorities: deque[int | None] = deque(maxlen=4096)
        self.clock: SimClock | None = None
        self.ranks: list[RealtimeRank] = []
        self.kv_events: KvEventPublisher | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.clock = SimClock(self.cfg.time_scale)
        self.ranks = [RealtimeRank(make_rank(self.cfg, i, self.cfg.seed), self.clock) for i in range(self.cfg.dp_size)]
        if self.cfg.disaggregation_mode != "null":  # PD: rooms meet in the process's KV fabric (sim/pd.py)
            FABRIC.time_scale = self.cfg.time_scale
            if self.cfg.disaggregation_mode == "prefill":
                FABRIC.register(self.bootstrap_address, self)
        kv = KvEventsConfig.parse(self.cfg.kv_events_config)
        if kv is not None:  # a fresh publisher per start: its sequence restarts at 0, as a restarted SGLang's does
            self.kv_events = KvEventPublisher(kv, [r.rank.cache for r in self.ranks], maps=self.cfg.at_least("0.5.23"),
                                              page_size=self.cfg.page_size, dp_attention=self.cfg.enable_dp_attention,
                                              port_collision=self.cfg.kv_events_port_collision)
            self.kv_events.start()
        for r in self.ranks:
            r.start()

    @property
    def bootstrap_address(self) -> str:
        """The key of this prefill server's bootstrap server in the fabric (one process: the port is unique)."""
        return str(self.cfg.disaggregation_bootstrap_port)

    async def stop(self) -> None:
        FABRIC.unregister(self.bootstrap_address, self)
        for r in self.ranks:
            await r.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None

    async def restart(self, startup_seconds: float = 0.0) -> None:
        """Crash and come back: in-flight requests are cut, the cache is empty, a new incarnation id shows."""
        for sub in list(self._inflight):
            for i, _ in enumerate(sub.requests):
                sub.queue.put_nowait((i, Event(EventKind.ABORT, self.now(), reason="reset", code=-1)))
        await self.stop()
        self._inflight.clear()
        self._started.clear()
        self.incarnation = uuid.uuid4().hex[:12]
        self.metrics = ReplicaMetrics(self)
        self.status = "starting"
        await self.start()
        if startup_seconds > 0:
            await self.clock.sleep(startup_seconds)  # type: ignore[union-attr]
        self.status = "ready"

    def now(self) -> float:
        return self.clock.now() if self.clock else 0.0

    def reconfigure(self, **changes: Any) -> None:
        """Atomic partial update of the server arguments and timing model (raises ValueError when invalid)."""
        new = self.cfg.with_overrides(**changes)
        if new.page_size != self.cfg.page_size or new.dp_size != self.cfg.dp_size or new.time_scale != self.cfg.time_scale:
            raise ValueError("page_size, dp_size and time_scale can only be set at start-up")
        self.cfg = new
        for r in self.ranks:
            r.rank.cfg = new
            r.kick()

    # -- faults ----------------------------------------------------------------------------------------------
    def take_fault(self, header: str | None, queued: bool = True) -> Fault | None:
        """A fault for this request: from the X-Sim-Fault header, else the next queued one-shot fault (`queued`)."""
        if header:
            return parse_fault_header(header)
        if queued and self.faults:
            f = self.faults[0]
            f.count -= 1
            if f.count <= 0:
                self.faults.pop(0)
            return f
        return None

    # -- requests --------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """Independent schedulers (each its own radix cache): `--dp-size`, with or without DP attention."""
        return self.cfg.dp_size

    def pick_rank(self, dp_rank: int | None) -> RealtimeRank:
        """A pinned rank, else SGLang's default dispatch outside PD (load_balance_method auto = round robin)."""
        if dp_rank is not None:
            return self.ranks[dp_rank]
        r = self.ranks[self._rr % len(self.ranks)]
        self._rr += 1
        return r

    def queue_full(self, rank: RealtimeRank) -> bool:
        limit = self.cfg.max_queued_requests
        return limit is not None and len(rank.rank.waiting) >= limit

    def output_len(self, prompt_key: int, idx: int, max_tokens: int | None, ignore_eos: bool, seed: Any,
                   agent: bool = False) -> tuple[int, str]:
        """Deterministic output length per (server seed, prompt, request seed, choice): where EOS falls (lognormal,
        the workload's median: `agent` for a chat turn that offers tools), capped by max_tokens; ignore_eos -> the
        cap."""
        cap = max_tokens if max_tokens is not None else self.cfg.context_length
        if ignore_eos:
            return cap, "length"
        # a str seed (not hash(), which is salted per process) keeps the draw the same in every process
        rng = random.Random(f"{self.cfg.seed}|{prompt_key}|{seed!r}|{idx}")
        median = self.cfg.eos_agent_median_tokens if agent else self.cfg.eos_median_tokens
        want = max(1, int(median * math.exp(rng.gauss(0.0, self.cfg.eos_sigma))))
        return (cap, "length") if want >= cap else (want, "stop")

    def submit(
        self,
        rank: RealtimeRank,
        tokens: np.ndarray | list[np.ndarray],
        namespace: str,
        lengths: list[tuple[int, str]],
        rid: str,
        internal: bool = False,
        priority: int = 0,
        before_submit: Callable[[SimRequest], None] | None = None,
    ) -> Submission:
        """Queue the request(s) on `rank`. `internal` (health probes) are not client requests: not in _inflight.
        `tokens` is the prompt of every choice, or a list with one prompt per choice (a completions batch)."""
        seqs = tokens if isinstance(tokens, list) else [tokens] * len(lengths)
        keys_of: dict[int, list[int]] = {}
        sub = Submission(rank, [])
        now = self.now()
        for i, (out_len, reason) in enumerate(lengths):
            seq = seqs[i]
            keys = keys_of.get(id(seq))
            if keys is None:
                keys = keys_of[id(seq)] = rank.rank.cache.page_keys(seq, namespace)
            def sink(ev: Event, i: int = i, q: asyncio.Queue[tuple[int, Event]] = sub.queue) -> None:
                q.put_nowait((i, ev))

            req = SimRequest(f"{rid}-{i}", keys, len(seq), out_len, reason, now, sink, priority=priority)
            sub.requests.append(req)
            if before_submit is not None:  # PD: the room is registered before the rank sees the request
                before_submit(req)
            rank.rank.submit(req)
        if not internal:
            self._inflight.add(sub)
            self._started[id(sub)] = time.monotonic()
        rank.kick()
        return sub

    def cancel(self, sub: Submission) -> None:
        """Client gone or request done: free whatever is still held (idempotent)."""
        now = self.now()
        for req in sub.requests:
            if not req.finished:
                sub.rank.rank.abort(req, now)
        sub.rank.kick()
        if sub in self._inflight:
            self._inflight.discard(sub)
            self.spans.append((self._started.pop(id(sub), time.monotonic()), time.monotonic()))

    def abort_all(self) -> None:
        for r in self.ranks:
            r.rank.abort_all(self.now(), "Aborted by /abort_request.", 500)
            r.kick()

    # -- snapshots -------------------------------------------------------------------------------------------
    def loads(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cap = self.cfg.max_total_num_tokens
        for r in self.ranks:
            rk = r.rank
            used = rk.used_tokens()
            c = rk.counters
            out.append(
                {
                    "dp_rank": rk.dp_rank,
                    "num_running_reqs": len(rk.running),
                    "num_waiting_reqs": len(rk.waiting),
                    "num_waiting_uncached_tokens": rk.waiting_uncached_tokens(),
                    "num_used_tokens": used,
                    "num_total_tokens": rk.cache.total_tokens + rk.reserved,
                    "max_total_num_tokens": cap,
                    "max_running_requests": self.cfg.max_running_requests,
                    "token_usage": round(used / cap, 4),
                    "gen_throughput": round(c.last_gen_throughput, 2),
                    "cache_hit_rate": round(c.cached_tokens / c.prompt_tokens, 4) if c.prompt_tokens else 0.0,
                    "utilization": round(min(1.0, len(rk.running) / self.cfg.max_running_requests), 4),
                }
            )
            if self.cfg.disaggregation_mode != "null":  # SGLang's disagg section: the PD queues of this rank
                out[-1]["disagg"] = pd_queues(rk)
        return out


def parse_fault_header(value: str) -> Fault:
    """`reset_after=5`, `reset_before_headers`, `hang`, `hang_after_first`, `status=503`."""
    key, _, arg = value.strip().partition("=")
    if key == "reset_after":
        return Fault("reset_after_chunks", n=int(arg or 0))
    if key == "status":
        return Fault("status", status=int(arg or 503))
    if key in ("hang", "hang_after_first", "reset_before_headers"):
        return Fault(key)
    raise ValueError(f"unknown X-Sim-Fault {value!r}")
