"""The shipped routing engine on a virtual clock: a fleet of simulated ranks (the real scheduler and radix cache)
behind one or more gateway instances, each running `routing/engine.py` — the decision and the feedback rules the
gateway runs, built by the same `routing/registry.build_engine` from a `Routing` config. No HTTP, no sleeping.

One instance = (engine, prefix index, load view). `shared=True` is the Redis-backed design (one index and one load
view for all instances); `shared=False` gives each instance its own (what routers with per-process state do).
The feedback arrives when the gateway would see it: the first token and the usage `t_api` after the engine's event.

`Fleet` is driven by `gateway replay` (traces) and by `run_fleet` in sim/fleet_wafer.py (the Wafer workload in token
space).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import GpuHourPricing, PerTokenPricing, PoolTiming, Routing
from gateway.dispatch.feedback import apply_effects
from gateway.flow.controller import FairTags, FlowController, Refusal, Ticket
from gateway.flow.gate import Pass, bound, budget_s, late, meets_sla, placed_cost, tightened, verdict
from gateway.flow.preempt import choose
from gateway.flow.settings import FlowControl, FlowPolicy
from gateway.flow.waits import WaitBoard
from gateway.prediction.pricing import request_cost
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.routing.decision import Decision
from gateway.routing.engine import Attempt, RoutingEngine
from gateway.routing.features import TargetInfo
from gateway.routing.load import MemoryLoadTracker
from gateway.routing.registry import build_engine
from gateway.routing.request import RoutingRequest
from gateway_lab.sim.des import EventLoop, VirtualRank
from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import ReplicaConfig, profile
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest

CHUNK = 256
MI355X_PRICE = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.10, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
B200_PRICE = PerTokenPricing(input_per_mtok=1.00, cached_input_per_mtok=0.20, output_per_mtok=3.20)
B200_TIMING = PoolTiming(base_s=0.12, prefill_tokens_per_s=20_000, decode_step_s=0.0365)
DEFAULT_Z = Routing().ttft_quantile_z  # the gateway's default, so the DES runs what a deployment runs


def idle_ttft(cfg: ReplicaConfig, prompt_len: int, cached: int) -> float:
    """TTFT of this prompt alone on an idle rank that holds `cached` of it (the slowdown's denominator)."""
    t = cfg.timing
    budget = min(cfg.chunked_prefill_size, cfg.max_prefill_tokens)
    done, left, total = cached, max(1, prompt_len - cached), t.t_api
    while left > 0:
        n = min(budget, left)
        total += t.prefill_time([(n, done + n / 2)])
        done, left = done + n, left - n
    return total


@dataclass
class Job:
    """One request as the fleet needs it: what the router sees and what the engine's cache sees."""

    req: RoutingRequest
    page_keys: list[int]  # chain keys of the prompt's full engine pages (same keys = same KV)
    prompt_len: int
    output_len: int


@dataclass
class Record:
    arrival: float
    instance: int
    name: str
    pool: str
    branch: str
    prompt: int
    output: int
    predicted_cached: int
    best_cached: int  # the most any candidate was predicted to hold (what the decision could have kept)
    self_hosted: bool
    predicted_ttft: float = 0.0  # the chosen candidate's, as the policy saw it (corrected)
    predicted_raw: float = 0.0  # the same before the learned correction
    cached: int = 0
    ttft: float | None = None
    idle_ttft: float | None = None
    end: float | None = None
    tenant: str = ""
    queued_s: float = 0.0  # time held by flow control before dispatch (part of the TTFT)
    refused: str = ""  # flow control's refusal reason (queue_full, queue_timeout, evicted, overloaded); never dispatched
    preempted: int = 0  # times flow control cancelled it before its first token and queued it again
    priority: int = 0  # the engine priority it was sent with (class + prefill level + flow control's boost)


class Instance:
    """One gateway instance: its engine (policy + corrector) over an index and a load view (maybe shared)."""

    def __init__(self, engine: RoutingEngine, index: MemoryPrefixIndex, loads: MemoryLoadTracker,
                 flow: FlowController | None = None, name: str = "i0") -> None:
        self.name = name
        self.engine = engine
        self.index = index
        self.loads = loads
        self.flow = flow  # the gateway's flow controller (gateway/flow/), when the fleet runs with one
        self.pump_at: float | None = None  # the next timed re-check of a non-empty queue


class Fleet:
    def __init__(self, targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing, instances: int = 1,
                 shared: bool = True, seed: int = 0, corrector: Callable[[], TtftCorrector] | None = None,
                 on_decision: Callable[[Instance, RoutingRequest, Decision[Any]], None] | None = None,
                 jitter: float = 0.0, schedule: str = "priority", itl: list[tuple[float, int]] | None = None,
                 flow: FlowControl | None = None, flow_tenants: Mapping[str, FlowPolicy] | None = None,
                 tenant_priority: Mapping[str, int] | None = None, preempt: bool = False) -> None:
        """`itl`: when given, every inter-token gap is appended to it as (seconds per token, tokens) — the engines
        then stream every decode step, which costs events; without it one TOKENS event per request.
        `flow`: run every instance's arrivals through the gateway's flow controller (gateway/flow/), its tenants'
        bands and weights from `flow_tenants` (a tenant not named there: the defaults); fair tags shared between
        instances when `shared` (the Redis-backed design). `tenant_priority`: each tenant's class value (the policy's
        `priority`: high 10, normal 0, low -10), sent to the engines with the prefill level as the gateway sends it.
        `preempt`: flow control's preemption (gateway/flow/preempt.py; the gateway does not cancel upstream requests
        yet, so it is measured here only)."""
        self.loop = EventLoop()
        clock = lambda: self.loop.now  # noqa: E731
        self.infos = [info for info, _ in targets]
        self.ranks: dict[str, VirtualRank] = {}
        for i, (info, cfg) in enumerate(targets):
            # only the first token and the finish matter here: one TOKENS event per request, not one per step;
            # self-hosted ranks schedule by priority, as deploy/sglang/ starts them (--enable-priority-scheduling),
            # or by shortest prefill (SCHEDULE=shortest-prefill-first there), which SGLang allows only without it
            over: dict[str, Any] = {"stream_interval": 1 if itl is not None else 1 << 30}
            if info.self_hosted and schedule == "priority":
                over["enable_priority_scheduling"] = True
            elif info.self_hosted:  # SGLang refuses priority scheduling with any other policy
                over["schedule_policy"] = schedule
            if jitter:  # each forward's duration x lognormal(0, jitter), drawn from the rank's seeded stream
                over["jitter_sigma"] = jitter
            self.ranks[info.name] = VirtualRank(Rank(cfg.with_overrides(**over), i, seed), self.loop)
        self.chunk_tokens = routing.chunk_tokens

        def make_index() -> MemoryPrefixIndex:
            idx = MemoryPrefixIndex(clock=clock, default_capacity=2_400_000 // routing.chunk_tokens)
            for info, cfg in targets:  # what the engine poller reads from /server_info in the gateway
                idx.set_capacity(info.key, cfg.max_total_num_tokens // routing.chunk_tokens)
            return idx

        shared_state = (make_index(), MemoryLoadTracker())
        self.flow_cfg = flow if flow is not None and flow.enabled else None
        self.flow_tenants = dict(flow_tenants or {})
        self.tenant_priority = dict(tenant_priority or {})
        # the self-hosted pool's timing (the gateway: the request's first pool's): a request's idle prefill time
        self.flow_timing = next((i.timing for i in self.infos if i.self_hosted), self.infos[0].timing)
        shared_tags = FairTags(flow.burst_credit if flow is not None else 0.0)
        self.instances = []
        # the targets queued requests wait for, per instance (gateway/flow/waits.py; over Redis between gateways)
        self.waits = WaitBoard() if shared and instances > 1 and self.flow_cfg and self.flow_cfg.share_waits else None
        for n in range(instances):
            index, loads = shared_state if shared else (make_index(), MemoryLoadTracker())
            engine = build_engine(routing, corrector() if corrector else None)
            engine.corrector.clock = clock  # a replica's own correction decays on the virtual clock, not the wall's
            ctl = FlowController(self.flow_cfg, shared_tags if shared else None) if self.flow_cfg else None
            self.instances.append(Instance(engine, index, loads, ctl, f"i{n}"))
        self.on_decision = on_decision
        self.records: list[Record] = []
        self.on_arrival: Callable[[], None] | None = None  # progress hook
        self.on_job: Callable[[Job], None] | None = None  # each job before it is routed (gateway_lab/replay/kv_modes.py)
        self.corrections = 0  # usage reports below the index's prediction (gateway_prefix_index_corrections_total)
        self.itl = itl
        self._sent: dict[Ticket, tuple[VirtualRank, SimRequest, Attempt, Instance, Record]] = {}  # preemptible
        self.preempt = preempt and self.flow_cfg is not None
        self.prefill_rate = {i.name: i.timing.prefill_tokens_per_s for i in self.infos if i.self_hosted}

    # -- setup -------------------------------------------------------------------------------------------------
    def warm(self, name: str, page_keys: Sequence[int], hashes: Sequence[int]) -> None:
        """A prefix already cached on `name`, and known to every instance (a fleet that has been running)."""
        rank = self.ranks[name].rank
        rank.cache.insert(page_keys, 0.0)
        info = next(i for i in self.infos if i.name == name)
        for inst in {id(x.index): x for x in self.instances}.values():
            inst.index.insert_sync(info.key, hashes, 1e9)

    # -- driving -----------------------------------------------------------------------------------------------
    def feed(self, arrivals: Iterable[tuple[float, Callable[[], Job]]]) -> None:
        """Arrivals in time order, each built lazily when it fires (a long trace never sits in memory whole)."""
        it: Iterator[tuple[float, Callable[[], Job]]] = iter(arrivals)
        n = [0]

        def next_arrival() -> None:
            item = next(it, None)
            if item is None:
                return
            t, make = item

            def fire() -> None:
                k = n[0]
                n[0] += 1
                self._arrive(k, make())
                if self.on_arrival:
                    self.on_arrival()
                next_arrival()

            self.loop.at(t, fire)

        next_arrival()

    def run(self) -> list[Record]:
        self.loop.run()
        return self.records

    def _decide(self, inst: Instance, job: Job, req: RoutingRequest | None = None) -> Decision[Any]:
        eng, infos = inst.engine, self.infos
        req = req or job.req
        matches = inst.index.match_sync(req.hashes, [i.key for i in infos]) if eng.uses_prefix and req.hashes else {}
        loads = {i.name: inst.loads.view(i.name) for i in infos}
        return eng.decide(req, infos, matches, loads, self.loop.now)

    def _arrive(self, k: int, job: Job) -> None:
        now = self.loop.now
        inst = self.instances[k % len(self.instances)]
        if self.on_job:
            self.on_job(job)
        ctl = inst.flow
        if ctl is None:
            self._dispatch(k, inst, job, self._decide(inst, job), now)
            return
        # flow control (gateway/flow/): the same controller and gate the gateway runs between admission and routing
        req, pol = job.req, self.flow_tenants.get(job.req.tenant, FlowPolicy())
        t = ctl.ticket(req.request_id, req.tenant, ctl.cfg.band_index(pol.band), pol.weight, job.prompt_len,
                       job.output_len, now, req.ttft_sla_s, pol.queue_timeout_s, (k, job),
                       bound(req, self.flow_timing, ctl.cfg.queue_for(ctl.cfg.band_index(pol.band))))
        if not ctl.contended(now):  # a lone flow goes straight to routing, charged for what it uses
            decision = self._decide(inst, job)
            ctl.charge(t, now, placed_cost(ctl, t, decision))
            self._dispatch(k, inst, job, decision, now, t)
            return
        if not len(ctl):  # nobody waiting: go now if routing predicts the SLA (gateway/flow/gate.py: meets_sla)
            q = ctl.cfg.queue_for(t.band)
            go = meets_sla(self._decide(inst, job), req, q)
            if go and go.chosen and self.waits and self.waits.elsewhere(inst.name, ctl.tags, now)(go.chosen.name, t):
                go = None  # another instance's request ahead of it waits for that target: in the queue instead
            if go is not None:
                if self.preempt and late(go, req, 0.0) and self._preempt(inst, t, job):
                    go = meets_sla(self._decide(inst, job), req, q) or go
                ctl.charge(t, now, placed_cost(ctl, t, go))
                self._dispatch(k, inst, job, go, now, t)
                return
        for r in ctl.offer(t, now, pol.max_queued):
            self._refused(r)
        self._pump(inst)

    def _refused(self, r: Refusal) -> None:
        k, job = r.ticket.payload
        self.records.append(Record(r.ticket.arrived, k % len(self.instances), "", "", r.reason, job.prompt_len,
                                   job.output_len, 0, 0, True, tenant=r.ticket.tenant, refused=r.reason,
                                   queued_s=self.loop.now - r.ticket.arrived))

    def _pump(self, inst: Instance) -> None:
        """Serve the queue while the routing engine predicts its next request meets its SLA (gateway/flow/gate.py);
        re-checked at each feedback event and every `tick_s` while anything waits."""
        ctl = inst.flow
        assert ctl is not None
        now = self.loop.now
        for r in ctl.expire(now):
            self._refused(r)
        cfg = ctl.cfg
        p = Pass(cfg.lookahead, self.waits.elsewhere(inst.name, ctl.tags, now) if self.waits else None)
        while (t := ctl.head(now, p.skip)) is not None:
            k, job = t.payload
            q = cfg.queue_for(t.band)
            if ctl.under_share(t):  # first in the fair order and under its share: its whole SLA (gate.meets_sla)
                decision = self._decide(inst, job)
                go = p.free(meets_sla(decision, job.req, q), t)
            else:
                decision = self._decide(inst, job, tightened(job.req, bound(job.req, self.flow_timing, q)))
                go = p.free(verdict(decision, job.req, q), t)
            if self.preempt and (go is None or late(go, job.req, now - t.arrived)) and self._preempt(inst, t, job):
                continue  # decide again: the lower bands' requests it cancelled are off their target
            if go is None:  # no room for it now: the next in the fair order may fit elsewhere
                if not p.passed(t, decision, ctl.tags.start(t.band, t.tenant)):
                    break
                continue
            ctl.grant(t, now, placed_cost(ctl, t, go))
            self._dispatch(k, inst, job, go, t.arrived, t)
        if self.waits is not None:
            self.waits.publish(inst.name, p.waits, now)
        if len(ctl) and (inst.pump_at is None or inst.pump_at <= now):
            inst.pump_at = now + ctl.cfg.tick_s

            def tick(inst: Instance = inst) -> None:
                inst.pump_at = None
                self._pump(inst)

            self.loop.at(inst.pump_at, tick)

    def _preempt(self, inst: Instance, head: Ticket, job: Job) -> bool:
        """Cancel lower bands' requests without a first token where that leaves `head` room (gateway/flow/preempt.py):
        aborted on their rank (what they prefilled stays in its cache), their load released, queued again."""
        ctl = inst.flow
        assert ctl is not None
        p = choose(head, ctl.inflight(), self.prefill_rate, budget_s(job.req, self.flow_timing, self.loop.now - head.arrived))
        if p is None:
            return False
        for v in p.victims:
            vr, sim_req, a, owner, rec = self._sent.pop(v)
            vr.rank.abort(sim_req, self.loop.now)
            # as a request that failed before its first token: its speculative index entries are withdrawn (what it
            # prefilled is in the rank's cache all the same; the usage report would have told the index)
            apply_effects(owner.engine.finished(a, failed=True), owner.index, owner.loads)
            self.records.remove(rec)
            ctl.requeue(v, self.loop.now)
        return True

    def _dispatch(self, k: int, inst: Instance, job: Job, decision: Decision[Any], arrived: float,
                  ticket: Ticket | None = None) -> None:
        """Dispatch `job` on `decision`; its TTFT counts from `arrived` (any wait in flow control's queue included).
        `ticket`: flow control's, preemptible until the first token."""
        now = self.loop.now
        eng, req = inst.engine, job.req
        if self.on_decision:
            self.on_decision(inst, req, decision)
        chosen = decision.chosen
        if chosen is None:  # shed: counted, never dispatched
            self.records.append(Record(arrived, k % len(self.instances), "", "", decision.branch, job.prompt_len,
                                       job.output_len, 0, 0, True, tenant=req.tenant))
            return
        a = Attempt(req, chosen, decision)
        feats = decision.features
        info = feats[chosen.name].info  # ranked holds the gateway's Targets when the fleet was built from a config
        rec = Record(arrived, k % len(self.instances), info.name, info.pool, decision.branch, job.prompt_len,
                     job.output_len, a.predicted_cached, max((c.cached_tokens for c in feats.values()), default=0),
                     info.self_hosted, feats[chosen.name].ttft, feats[chosen.name].ttft_raw, tenant=req.tenant,
                     queued_s=now - arrived, preempted=ticket.preempted if ticket is not None else 0)
        self.records.append(rec)
        apply_effects(eng.dispatched(a), inst.index, inst.loads)
        vr = self.ranks[info.name]
        cfg = vr.rank.cfg
        t_api = cfg.timing.t_api
        loop = self.loop

        last = [now]

        def sink(ev: Event) -> None:
            if ev.kind is EventKind.TOKENS and self.itl is not None and ev.tokens:
                self.itl.append(((ev.time - last[0]) / ev.tokens, ev.tokens))
                last[0] = ev.time
            if ev.kind is EventKind.FIRST:
                last[0] = ev.time
                if ticket is not None and inst.flow is not None:
                    inst.flow.first_byte(ticket)
                    self._sent.pop(ticket, None)
                rec.ttft = ev.time + t_api - arrived
                rec.cached = sim_req.cached
                rec.idle_ttft = idle_ttft(cfg, job.prompt_len, sim_req.cached)
                ttft = ev.time + t_api - now  # what the engine took: the corrector learns its own prediction's error

                def first() -> None:
                    apply_effects(eng.first_token(a, ttft), inst.index, inst.loads)
                    if inst.flow is not None and len(inst.flow):
                        self._pump(inst)

                loop.at(ev.time + t_api, first)
            elif ev.kind is EventKind.FINISH:
                rec.end = ev.time + t_api
                cached = sim_req.cached

                def done() -> None:
                    corrected = eng.usage(a, cached) if info.prefix_cache else []
                    self.corrections += bool(corrected)
                    apply_effects(corrected, inst.index, inst.loads)
                    apply_effects(eng.finished(a), inst.index, inst.loads)
                    if inst.flow is not None and len(inst.flow):
                        self._pump(inst)

                loop.at(ev.time + t_api, done)

        sim_req = SimRequest(req.request_id, job.page_keys, job.prompt_len, max(1, job.output_len), "length", now, sink)
        # as the gateway sends it: the class, the prefill level, flow control's boost (FlowController.engine_boost)
        rec.priority = sim_req.priority = (self.tenant_priority.get(req.tenant, 0) + eng.prefill_level(a)
                                           + (ticket.boost if ticket is not None else 0))
        if ticket is not None and inst.flow is not None and self.preempt and info.self_hosted:
            inst.flow.sent(ticket, info.name, a.uncached)
            self._sent[ticket] = (vr, sim_req, a, inst, rec)
        vr.rank.submit(sim_req)
        vr.kick()


def mi355x_targets(replicas: int, b200: int = 0) -> list[tuple[TargetInfo[Any], ReplicaConfig]]:
    """`replicas` MI355X TP4 ranks (2.4M-token KV each; 2 per node) and `b200` per-token B200 replicas."""
    cfg, b_cfg = profile("mi355x-glm52-tp4"), profile("b200-glm52")
    out = [(TargetInfo(f"mi355x-{i}", f"mi355x-{i}@0", "mi355x", PoolTiming(), MI355X_PRICE, None), cfg)
           for i in range(replicas)]
    out += [(TargetInfo(f"b200-{i}", f"b200-{i}@0", "b200", B200_TIMING, B200_PRICE, None, prefix_cache=False), b_cfg)
            for i in range(b200)]
    return out


def cost_usd(info: TargetInfo[Any], r: Record) -> float:
    return request_cost(info.pricing, r.prompt, r.cached, r.output)


__all__ = ["Fleet", "Instance", "Job", "Record", "cost_usd", "idle_ttft", "mi355x_targets"]
