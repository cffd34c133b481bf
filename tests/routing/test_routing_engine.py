"""One routing engine: the gateway's pipeline and feedback and the virtual-clock fleet behind `gateway replay` run
the same decision and feedback code, so a replay figure is a measurement of what the gateway ships."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.dispatch.feedback import Attempt, Feedback, apply_effects
from gateway.observability.metrics import GatewayMetrics
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway.routing.engine import IndexDrop, IndexWrite, LoadDelta
from gateway.routing.features import TargetInfo
from gateway.routing.load import MemoryLoadTracker
from gateway.routing.pipeline import PipelineRouter
from gateway.routing.registry import build_engine
from gateway.routing.request import RoutingRequest
from gateway.upstreams import UpstreamRegistry
from gateway_lab.replay.run import replay, targets_from_config
from gateway_lab.sim.fleet import Fleet, Instance


def synthetic_trace(n: int, seed: int = 0) -> list[TraceRecord]:
    """Sessions sharing system prompts, growing turn by turn, some long prompts, bursty arrivals."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    systems = [[next(next_id) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    sessions: list[list[int]] = []
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(4.0) * 1000
        if not sessions or rng.random() < 0.3:
            sessions.append(list(rng.choice(systems)))
        s = rng.choice(sessions)
        s.extend(next(next_id) for _ in range(rng.choice([1, 2, 4, 40])))
        length = len(s) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1)
        out.append(TraceRecord(t, length, rng.randint(20, 400), tuple(s)))
    return out


def gateway_config(policy: str, queue_drain: bool = False) -> GatewayConfig:
    """Four SGLang replicas (never contacted: the replay simulates them)."""
    pool = {"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2",
            "replicas": [{"name": f"mi355x-{i}", "url": f"http://127.0.0.1:{9 + i}"} for i in range(4)],
            "pricing": {"type": "gpu_hour", "gpus_per_replica": 4, "usd_per_gpu_hour": 2.1,
                        "prefill_tokens_per_s": 16700, "decode_tokens_per_s": 3600}}
    return parse_config({"models": [{"name": "glm-5.2", "pools": ["mi355x"]}], "pools": [pool],
                         "tenants": [{"name": "t", "api_key_hashes": ["0" * 64], "models": ["glm-5.2"]}],
                         "routing": {"policy": policy, "queue_drain": queue_drain}})


@pytest.mark.parametrize("policy, queue_drain", [("prefix_sla_cost", False), ("prefix_sla_cost", True),
                                                 ("least_loaded", False)])
def test_replay_and_gateway_make_the_same_decision_for_the_same_inputs(policy: str, queue_drain: bool) -> None:
    """At every arrival of a replay, the gateway's own PipelineRouter (registry -> candidates -> one lookup + one load
    snapshot -> engine), given the same index and load, ranks the same targets on the same branch with the same
    features: the replay runs the gateway's routing, not a copy."""
    cfg = gateway_config(policy, queue_drain)
    registry = UpstreamRegistry(cfg)
    route = cfg.models[0]
    aio = asyncio.new_event_loop()
    seen: list[str] = []
    fleets: list[Fleet] = []

    def check(inst: Instance, req: RoutingRequest, decision) -> None:  # type: ignore[no-untyped-def]
        router = PipelineRouter(registry, inst.index, inst.loads, inst.engine, clock=lambda: fleets[0].loop.now)
        mine = aio.run_until_complete(router.decide(req, route))
        assert [t.name for t in mine.ranked] == [t.name for t in decision.ranked]
        assert mine.branch == decision.branch
        assert {n: (c.cached_tokens, c.ttft, c.cost) for n, c in mine.features.items()} == \
            {n: (c.cached_tokens, c.ttft, c.cost) for n, c in decision.features.items()}
        seen.append(decision.branch)

    def hook(fleet: Fleet) -> None:
        fleets.append(fleet)
        fleet.on_decision = check

    r = replay(synthetic_trace(400), targets_from_config(cfg), cfg.routing, speed=3.0, fleet_hook=hook)
    aio.close()
    assert len(seen) == r.requests == 400
    if policy == "prefix_sla_cost":  # the comparison covered more than one branch, hits included
        assert "prefix_hit" in seen and len(set(seen)) > 1 and r.hit_rate > 0.2


def test_gateway_feedback_applies_exactly_the_engines_effects() -> None:
    """Feedback (async, the gateway's) and apply_effects (the fleet's) leave the same index and load after the same
    outcomes: dispatch, first token, a correction, a failure before the first token."""
    cfg = gateway_config("prefix_sla_cost")
    targets = targets_from_config(cfg)
    infos = [i for i, _ in targets]
    hashes = tuple(range(100, 140))
    req = RoutingRequest("r1", "t", "glm-5.2", "chat/completions", True, 40 * 256 + 10, None, hashes)
    fb_index, fb_loads = MemoryPrefixIndex(), MemoryLoadTracker()
    fx_index, fx_loads = MemoryPrefixIndex(), MemoryLoadTracker()
    for idx in (fb_index, fx_index):
        idx.insert_sync(infos[0].key, hashes[:20], 900)
    engine = build_engine(cfg.routing)
    fb = Feedback(fb_index, fb_loads, engine, GatewayMetrics(), cfg.routing)

    async def gateway_side() -> None:
        d = engine.decide(req, infos, fb_index.match_sync(hashes), {i.name: fb_loads.view(i.name) for i in infos})
        ok, failed = Attempt(req, d.chosen, d), Attempt(req, d.ranked[1], d)
        fb.dispatched(ok)
        fb.first_token(ok, 1.0)
        fb.usage(ok, 5 * 256)  # the engine held far less than predicted: a correction
        fb.finished(ok)
        fb.dispatched(failed)
        fb.finished(failed, failed=True)
        await fb.drain()

    asyncio.run(gateway_side())
    # the fleet side, on the same decision
    engine2 = build_engine(cfg.routing)
    d = engine2.decide(req, infos, fx_index.match_sync(hashes), {i.name: fx_loads.view(i.name) for i in infos})
    assert d.chosen.name == infos[0].name and d.branch == "prefix_hit"
    ok, failed = Attempt(req, d.chosen, d), Attempt(req, d.ranked[1], d)
    e1 = engine2.dispatched(ok)
    assert LoadDelta(infos[0].name, req.prompt_tokens - 20 * 256, 1) in e1 and any(isinstance(e, IndexWrite) for e in e1)
    apply_effects(e1, fx_index, fx_loads)
    apply_effects(engine2.first_token(ok, 1.0), fx_index, fx_loads)
    corr = engine2.usage(ok, 5 * 256)
    assert corr == [IndexDrop(infos[0].key, hashes[5:20], "correct")]
    apply_effects(corr, fx_index, fx_loads)
    apply_effects(engine2.finished(ok), fx_index, fx_loads)
    apply_effects(engine2.dispatched(failed), fx_index, fx_loads)
    withdraw = engine2.finished(failed, failed=True)
    assert IndexDrop(infos[1].key, hashes, "withdraw") in withdraw
    apply_effects(withdraw, fx_index, fx_loads)
    for idx in (fb_index, fx_index):
        assert idx.match_sync(hashes) == {infos[0].key: 5}  # confirmed then corrected down to the real hit
    assert {i.name: fb_loads.view(i.name) for i in infos} == {i.name: fx_loads.view(i.name) for i in infos}
    assert all(v.inflight == 0 and v.queued_prefill_tokens == 0 for v in (fx_loads.view(i.name) for i in infos))


def test_hosted_targets_get_no_index_entries() -> None:
    """A hosted per-token endpoint's cache is opaque to us: the engine writes no prefix entries for it (a capability
    on the target, not a check on a backend or policy name)."""
    engine = build_engine(gateway_config("prefix_sla_cost").routing)
    info = TargetInfo("b200", "b200@0", "b200", targets_from_config(gateway_config("round_robin"))[0][0].timing, None,
                      None, prefix_cache=False)
    req = RoutingRequest("r", "t", "m", "chat/completions", True, 3000, None, (1, 2, 3))
    d = engine.decide(req, [info], {}, {})
    assert not any(isinstance(e, IndexWrite) for e in engine.dispatched(Attempt(req, d.chosen, d)))


def test_prefill_level_orders_by_uncached_tokens_until_the_replica_is_overloaded() -> None:
    """routing.shortest_prefill_first: the level a request adds to its class's priority falls as its uncached prefill
    on the chosen target grows; past 2 x its SLA of queued prefill on that target it is 0 (arrival order), so a
    replica behind on its work does not let short requests starve long ones; off, always 0."""
    from gateway.prediction.ttft import LoadView

    cfg = gateway_config("prefix_sla_cost")
    infos = [i for i, _ in targets_from_config(cfg)]
    rate = infos[0].timing.prefill_tokens_per_s
    hashes = tuple(range(100, 140))

    def level(engine: object, warm_chunks: int, queued_s: float) -> int:
        index = MemoryPrefixIndex()
        index.insert_sync(infos[0].key, hashes[:warm_chunks], 900)
        req = RoutingRequest("r", "t", "glm-5.2", "chat/completions", True, 40 * 256 + 10, None, hashes,
                             ttft_sla_s=2.0)
        loads = {i.name: LoadView(queued_s * rate, 1) for i in infos}
        d = engine.decide(req, infos, index.match_sync(hashes), loads)  # type: ignore[attr-defined]
        return int(engine.prefill_level(Attempt(req, infos[0], d)))  # type: ignore[attr-defined]

    on = build_engine(cfg.routing)
    assert cfg.routing.shortest_prefill_first
    assert level(on, 40, 0.5) == 9  # 10 uncached tokens: the front of its class
    assert level(on, 20, 0.5) == 4  # 5,130 uncached
    assert level(on, 0, 0.5) == 3  # 10,250 uncached
    assert level(on, 40, 3.9) == 9 and level(on, 40, 4.1) == 0  # past 2 x 2.0 s of queued prefill: arrival order
    off = build_engine(cfg.routing.model_copy(update={"shortest_prefill_first": False}))
    assert level(off, 40, 0.5) == 0


def test_the_correction_learns_what_the_target_took_not_the_gateways_wait() -> None:
    """A request held in the gateway (flow control's queue, a large body's front half) waits before it is sent. The
    TTFT correction and the outlier residual judge the target on the time from the send to the first token; the
    client's wait still counts against the SLA. The same first token, once after no wait and once after 5 s held,
    teaches the corrector the same thing."""
    cfg = gateway_config("prefix_sla_cost")
    infos = [i for i, _ in targets_from_config(cfg)]
    req = RoutingRequest("r1", "t", "glm-5.2", "chat/completions", True, 4000, None, ())
    seen = {}
    for wait in (0.0, 5.0):
        engine = build_engine(cfg.routing)
        metrics = GatewayMetrics()
        fb = Feedback(MemoryPrefixIndex(), MemoryLoadTracker(), engine, metrics, cfg.routing)
        d = engine.decide(req, infos, {}, {i.name: MemoryLoadTracker().view(i.name) for i in infos})
        a = Attempt(req, d.chosen, d)

        async def run(a: Attempt = a, fb: Feedback = fb, wait: float = wait) -> None:
            fb.dispatched(a)
            a.sent_at = 100.0
            # the engine took twice its raw prediction; the client waited that plus the gateway's `wait`
            engine_took = 2 * a.ttft_raw
            fb.first_token(a, wait + engine_took, at=100.0 + engine_took)
            await fb.drain()

        asyncio.run(run())
        assert a.ttft_raw > 0
        missed = metrics.sla.labels("t", "missed")._value.get()
        seen[wait] = (engine.corrector.replica_factor(a.name), engine.corrector.get(a.pool, a.regime),
                      fb.stats.view(a.name).ttft_residual_p50, fb.stats.view(a.name).ttft_p50_s, missed)
    assert seen[0.0][:4] == pytest.approx(seen[5.0][:4], rel=1e-4)  # the factor decays with the clock between the two
    assert seen[0.0][0] > 1.0  # it did learn the target's own slowness
    assert seen[5.0][4] == 1 and seen[0.0][4] == 0  # the SLA counts what the client waited
