"""One DP rank's scheduler as a clock-free state machine (spec sections 5 and 6).

The caller owns time: `plan(now)` says what the next forward is and how long it takes; the caller waits that
long (real time in `realtime.py`, a virtual clock in `des.py`) and calls `complete(step, end)`. Requests hear
about progress through their `sink` callback, so the same scheduler runs behind HTTP and in a discrete-event
simulation with no I/O.

Rules: FCFS (or, with `enable_priority_scheduling`, by priority then arrival, and a waiting request that beats a
running one by more than `priority_scheduling_preemption_threshold` retracts it when the batch is full); prefill
strictly before decode (no mixed batches); one prefill forward takes up to
`chunked_prefill_size` uncached tokens across waiting requests in order (the last may be split and continues
first next time; with `schedule_policy: shortest-prefill-first`, 0.5.21+, the waiting queue goes by uncached tokens and
the continuing chunk is capped to leave room for the shorter waiting prefills, one chunked request at a time);
admission stops at `max_running_requests` (running + picked) or when a new request's
reservation (uncached prompt + output tokens) does not fit in KV even after evicting unlocked cache; a decode
step advances every running request by alpha tokens (a fractional accumulator, so 3.5 means 3, 4, 3, 4, ...).
"""

from __future__ import annotations

import math
import random

from gateway_lab.sim.profiles import SHORTEST_PREFILL_FIRST, ReplicaConfig
from gateway_lab.sim.radix_cache import Node, PrefixCache
from gateway_lab.sim.sim_request import Event, EventKind, RankCounters, SimRequest, Step


class Rank:
    def __init__(self, cfg: ReplicaConfig, dp_rank: int = 0, seed: int = 0) -> None:
        cfg.check_schedule()  # SGLang refuses to start with these flags; so does every simulated rank
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.cache = PrefixCache(cfg.page_size)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.reserved = 0  # KV tokens promised to admitted requests and not yet in the tree
        self.counters = RankCounters()
        self.rng = random.Random(seed * 1000 + dp_rank)
        self.slow_factor = 1.0  # fault: every forward k times slower
        # faults (/_sim/fault kind "slow"): prefill forwards alone k times slower (TTFT), or decode forwards alone
        # (inter-token latency): a gray failure, the replica answers everything, just late
        self.prefill_slow = 1.0
        self.decode_slow = 1.0
        self.forward_sleep = 0.0  # fault: seconds added to every forward (SGLang /slow_down)
        self.paused = False  # fault: frozen scheduler (SGLang /pause_generation in_place)

    # -- inputs ----------------------------------------------------------------------------------------------
    def can_hold(self, prompt_len: int, output_len: int) -> bool:
        return prompt_len + output_len <= self.cfg.max_total_num_tokens

    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.counters.requests += 1
        if self.cfg.enable_priority_scheduling:
            self._sort_waiting()

    @property
    def shortest_prefill_first(self) -> bool:
        return self.cfg.schedule_policy == SHORTEST_PREFILL_FIRST

    def _pages(self, n: int) -> int:
        """n tokens in whole pages (what SGLang charges and reserves)."""
        ps = self.cfg.page_size
        return -(-n // ps) * ps

    def _spf_work(self, req: SimRequest, now: float) -> int:
        """SGLang's `_shortest_prefill_work`: the tokens a waiting request would prefill, from a fresh match (which,
        as SGLang's, refreshes the matched pages' access times)."""
        if req.started:
            return max(1, req.uncached - req.prefilled)
        matched = len(self.cache.match(req.keys, now)) * self.cfg.page_size
        return max(1, req.prompt_len - matched)

    def _shortest_prefill_pass(self, now: float, budget: int) -> int | None:
        """One forward's calc_priority and shortest_prefill_chunk_limit: sort the waiting queue by (shares a prefix
        with an earlier waiting request while holding none of it cached, uncached work, arrival), the chunked
        request first; return the cap on the chunked request's next chunk (None: none).
        The in-batch dedup matches the first page (SGLang: >= 32 tokens of a waiting-queue radix tree)."""
        work = {r: self._spf_work(r, now) for r in self.waiting}
        self.cache.compact()  # a match per waiting request per forward: drop the heap entries they made stale
        seen: set[int] = set()
        deferred: set[SimRequest] = set()
        for r in self.waiting:
            if r.started or not r.keys or work[r] < r.prompt_len:
                continue
            if r.keys[0] in seen:
                deferred.add(r)
            else:
                seen.add(r.keys[0])
        self.waiting.sort(key=lambda r: (not r.started, r in deferred, work[r], r.arrival))
        head = self.waiting[0]
        return self._chunk_limit(head, work, budget) if head.started else None

    def _chunk_limit(self, head: SimRequest, work: dict[SimRequest, int], budget: int) -> int | None:
        """SGLang's `shortest_prefill_chunk_limit`: the continuing chunk leaves room for the waiting requests
        (in order) that need less than it still does, a page apart; None when none fits."""
        ps = self.cfg.page_size
        if budget < 2 * ps:
            return None
        remaining = head.uncached - head.prefilled
        reserved = 0
        for r in self.waiting:
            if r is head:
                continue
            w, charge = work[r], self._pages(work[r])
            if w >= remaining or reserved + charge > budget - ps:
                break
            reserved += charge
        return (budget - reserved) // ps * ps if reserved else None

    def _rank_key(self, req: SimRequest) -> int:
        """Smaller is served first: SGLang sorts by priority x sign (-1: higher values first) then arrival."""
        return req.priority * (1 if self.cfg.schedule_low_priority_values_first else -1)

    def _sort_waiting(self) -> None:
        # a request already part-way through chunked prefill keeps its place (SGLang's chunked_req goes first)
        self.waiting.sort(key=lambda r: (not r.started, self._rank_key(r), r.arrival))

    def _preempt_for(self, req: SimRequest, now: float) -> bool:
        """Retract the lowest-priority running request if `req` beats it by more than the threshold
        (schedule_policy.preempt_to_schedule); it goes back to waiting and re-prefills later."""
        cfg = self.cfg
        if not cfg.enable_priority_scheduling or cfg.disable_priority_preemption:
            return False
        live = [r for r in self.running if not r.finished]
        if not live:
            return False
        victim = max(live, key=lambda r: (self._rank_key(r), r.arrival))
        if self._rank_key(victim) - self._rank_key(req) <= cfg.priority_scheduling_preemption_threshold:
            return False
        self.running.remove(victim)
        self._release(victim, now)
        victim.started = False
        victim.prefilled = 0
        victim.cached = 0
        victim.preempted += 1
        self.waiting.append(victim)
        return True

    def abort(self, req: SimRequest, now: float) -> None:
        """Client went away or the request was aborted: free its KV, drop it from queues."""
        if req.finished:
            return
        req.finished = True
        self.counters.aborted += 1
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req, now)

    # -- scheduling ------------------------------------------------------------------------------------------
    def plan(self, now: float) -> Step | None:
        if self.paused:
            return None
        step = self._plan_prefill(now)
        if step is None and self.running:
            b = len(self.running)
            model = self.cfg.timing.decode_time(b)
            step = Step("decode", self._realise(model * self.decode_slow), model, batch=list(self.running))
        return step

    def _plan_prefill(self, now: float) -> Step | None:
        cfg = self.cfg
        budget = min(cfg.chunked_prefill_size, cfg.max_prefill_tokens)
        picks: list[tuple[SimRequest, int]] = []
        chunks: list[tuple[int, float]] = []
        preempted = False
        limit: int | None = None
        chunk_open = False  # a request picked this forward stays chunked after it
        if self.shortest_prefill_first and self.waiting:
            if len(self.running) >= cfg.max_running_requests and not self.waiting[0].started:
                return None  # no request slot: SGLang returns before calc_priority (and cannot preempt here)
            limit = self._shortest_prefill_pass(now, budget)
        for req in list(self.waiting):
            if budget <= 0:
                break
            if len(self.running) + len(picks) >= cfg.max_running_requests:
                if req.started or not self._preempt_for(req, now):
                    break
                preempted = True
            if chunk_open and not req.started and self._pages(self._spf_work(req, now)) > budget:
                break  # SGLang splits no second request while the capped one is still chunked
            if not req.started and not self._admit(req, now):
                break  # FCFS: the head blocks the rest
            n = min(req.uncached - req.prefilled, budget)
            if limit is not None and req.started and not picks:
                n = min(n, limit)  # the chunked request yields room to shorter waiting prefills
                chunk_open = n < req.uncached - req.prefilled
            picks.append((req, n))
            chunks.append((n, req.cached + req.prefilled + n / 2))
            budget -= n
        if preempted:
            self._sort_waiting()
        if not picks:
            return None
        model = cfg.timing.prefill_time(chunks)
        return Step("prefill", self._realise(model * self.prefill_slow), model, picks=picks)

    def _admit(self, req: SimRequest, now: float) -> bool:
        cfg, cache = self.cfg, self.cache
        ps = cfg.page_size
        path: list[Node] = [] if cfg.disable_radix_cache else cache.match(req.keys, now)
        cached = max(0, min(len(path) * ps, req.prompt_len - 1) // ps * ps)  # never negative, even for 0 tokens
        path = path[: cached // ps]
        need = (req.prompt_len - cached) + req.output_len
        free = cfg.max_total_num_tokens - cache.total_tokens - self.reserved
        cache.lock(path)  # before evicting, so the matched prefix survives
        if need > free:
            if need > free + cache.evictable_tokens:
                cache.unlock(path, now)
                return False
            cache.evict(need - free)
        req.started = True
        req.cached = cached
        req.path = path
        req.reserved = need
        self.reserved += need
        self.counters.prompt_tokens += req.prompt_len
        self.counters.cached_tokens += cached
        return True

    def _realise(self, model: float) -> float:
        d = model * self.slow_factor + self.forward_sleep
        sigma = self.cfg.timing.jitter_sigma
        if sigma:
            d *= math.exp(self.rng.gauss(0.0, sigma))
        return d

    # -- step completion -------------------------------------------------------------------------------------
    def complete(self, step: Step, now: float) -> None:
        self.counters.busy_time += step.duration
        if step.kind == "prefill":
            self._complete_prefill(step, now)
        else:
            self._complete_decode(step, now)

    def _complete_prefill(self, step: Step, now: float) -> None:
        cfg, cache = self.cfg, self.cache
        ps = cfg.page_size
        self.counters.prefill_forwards += 1
        done: list[SimRequest] = []
        for req, n in step.picks:
            if req.finished:
                continue
            req.prefilled += n
            self.counters.prefill_compute_tokens += n
            if not cfg.disable_radix_cache:
                full = (req.cached + req.prefilled) // ps
                if full > len(req.path):
                    path = cache.insert(req.keys[:full], now)
                    new = path[len(req.path) :]
                    cache.lock(new)
                    moved = min(len(new) * ps, req.reserved)
                    req.reserved -= moved
                    self.reserved -= moved
                    req.path = path
            if req.prefilled >= req.uncached:
                done.append(req)
        if done:
            finished_ids = {id(r) for r in done}
            self.waiting = [r for r in self.waiting if id(r) not in finished_ids]
            for req in done:
                if req.first_token_time is not None:  # a retracted request re-prefilled: it resumes decoding
                    self.running.append(req)
                    continue
                self._first_token(req, now)

    def _first_token(self, req: SimRequest, now: float) -> None:
        """Its prompt is in the cache: the first token is out, and it decodes from here (or is done)."""
        req.done_prefill = True
        req.first_token_time = now
        req.generated = 1
        self.counters.generation_tokens += 1
        req.sink(Event(EventKind.FIRST, now, tokens=1))
        if req.generated >= req.output_len:
            self._finish(req, now)
        else:
            self.running.append(req)

    def _complete_decode(self, step: Step, now: float) -> None:
        alpha = self.cfg.timing.alpha
        interval = self.cfg.stream_interval
        self.counters.decode_steps += 1
        produced = 0
        still: list[SimRequest] = []
        for req in step.batch:
            if req.finished:
                continue
            req.frac += alpha
            n = int(req.frac)
            req.frac -= n
            n = min(n, req.output_len - req.generated)
            req.generated += n
            produced += n
            req.unsent += n
            req.steps_unsent += 1
            last = req.generated >= req.output_len
            if req.unsent and (last or req.steps_unsent >= interval):
                # the last chunk carries the finish reason (completions streams put it on the text chunk)
                req.sink(Event(EventKind.TOKENS, now, tokens=req.unsent, reason=req.finish_reason if last else ""))
                req.unsent = 0
                req.steps_unsent = 0
            if last:
                self._finish(req, now)
            else:
                still.append(req)
        # requests admitted to running during this step (none: prefill and decode never overlap) stay
        self.running = still + [r for r in self.running if r not in step.batch and not r.finished]
        self.counters.generation_tokens += produced
        if step.duration > 0:
            self.counters.last_gen_throughput = produced / step.duration

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finished = True
        self._release(req, now)
        req.sink(Event(EventKind.FINISH, now, reason=req.finish_reason))

    def _release(self, req: SimRequest, now: float) -> None:
        if req.path:
            self.cache.unlock(req.path, now)
            req.path = []
        self.reserved -= req.reserved
        req.reserved = 0

    # -- control ---------------------------------------------------------------------------------------------
    def abort_all(self, now: float, reason: str, code: int) -> None:
        for req in list(self.waiting) + list(self.running):
            self.abort(req, now)
            req.sink(Event(EventKind.ABORT, now, reason=reason, code=code))

    def flush_cache(self) -> bool:
        """SGLang flushes only when nothing runs or waits."""
        if self.waiting or self.running:
            return False
        self.cache.flush()
        return True

    # -- load snapshot ---------------------------------------------------------------------------------------
    def waiting_uncached_tokens(self) -> int:
        return sum(r.uncached - r.prefilled if r.started else r.prompt_len for r in self.waiting)

    def used_tokens(self) -> int:
        """KV held by requests (locked tree pages + their private reservations), as SGLang's token_usage."""
        return self.cache.locked_tokens + self.reserved
