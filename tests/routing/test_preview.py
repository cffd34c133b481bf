"""Previews of a weight or pin change re-decide past decisions with the shipped policy (pure, table-driven): only
what the change touches moves, and the counts add up to the decisions considered."""

from gateway.config import GpuHourPricing, PerTokenPricing, PoolTiming, Routing
from gateway.prediction.ttft import TtftCorrector
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.preview import pinned, preview, reweighted
from gateway.routing.registry import build_engine
from gateway.routing.request import RoutingRequest

GPU = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.1, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
TOKEN = PerTokenPricing(input_per_mtok=1.0, cached_input_per_mtok=0.2, output_per_mtok=3.2)
T = PoolTiming()
INFOS = [TargetInfo("r0", "r0@0", "mi", T, GPU, None), TargetInfo("r1", "r1@0", "mi", T, GPU, None),
         TargetInfo("b200", "b200@0", "hosted", PoolTiming(base_s=0.12, prefill_tokens_per_s=20_000), TOKEN, None)]
ENGINE = build_engine(Routing())


def past(n: int, tenant: str = "t") -> list:
    out = []
    for i in range(n):
        req = RoutingRequest(request_id=str(i), tenant=tenant, model="glm", endpoint="chat/completions", stream=True,
                             prompt_tokens=8000, max_output_tokens=100, hashes=tuple(range(i * 100, i * 100 + 31)),
                             group_key=i * 7919)
        cands = build_candidates(req, INFOS, {}, {}, TtftCorrector().get, 256)
        out.append((req, ENGINE.policy(req, cands)))
    return out


def test_reweighting_divides_only_that_pools_cost():
    cands = build_candidates(past(1)[0][0], INFOS, {}, {}, TtftCorrector().get, 256)
    out = {c.name: c for c in reweighted(cands, "mi", 0.5)}
    before = {c.name: c for c in cands}
    assert out["r0"].cost == before["r0"].cost * 2 and out["r0"].info.weight == 0.5
    assert out["b200"] is before["b200"]
    assert [c.name for c in reweighted(cands, "mi", 0)] == ["b200"]  # weight 0: the pool takes nothing new
    assert [c.name for c in pinned(cands, "hosted")] == ["b200"]


def test_weight_zero_moves_every_decision_off_the_pool_and_nothing_else():
    decisions = past(12)
    on_mi = sum(1 for _, d in decisions if d.chosen.pool == "mi")
    assert 0 < on_mi  # the self-hosted pool is the cheaper one here
    p = preview(ENGINE, decisions, pool="mi", weight=0)
    assert p["decisions"] == 12 and p["would_move"] == on_mi and p["would_stay"] == 12 - on_mi
    assert p["moves_by_pool"] == [{"from": "mi", "to": "hosted", "requests": on_mi}]
    unchanged = preview(ENGINE, decisions, pool="mi", weight=1.0)
    assert unchanged["would_move"] == 0 and unchanged["would_stay"] == 12


def test_a_pin_counts_only_that_tenants_decisions():
    decisions = past(5, "a") + past(7, "b")
    p = preview(ENGINE, decisions, tenant="b", pin_pool="hosted")
    assert p["decisions"] == 7 and p["would_move"] + p["would_stay"] == 7
    assert all(m["to"] == "b200" for m in p["moves"])
    none = preview(ENGINE, decisions, tenant="b", pin_pool="elsewhere")
    assert none["would_have_no_replica"] == 7 and none["would_move"] == 0
