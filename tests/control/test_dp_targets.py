"""A DP server's rank targets in the registry: split and merged in place (routing holds `by_pool` lists), sharing
what the config and the control plane say about their server."""

from gateway.config import parse_config
from gateway.control.plane import ControlPlane
from gateway.control.state import ControlState, PoolOverride
from gateway.control.store import MemoryControlStore
from gateway.upstreams import UpstreamRegistry, release

CFG = parse_config({
    "models": [{"name": "glm-5.2", "pools": ["mi"]}],
    "pools": [{"name": "mi", "kind": "sglang", "model": "m", "replicas": [
        {"name": "mi-0", "url": "http://127.0.0.1:1"}, {"name": "mi-1", "url": "http://127.0.0.1:2", "dp_size": 2}]}],
    "tenants": [{"name": "t", "api_key_hashes": ["0" * 64], "models": ["glm-5.2"]}],
})


def test_split_in_place_keeps_the_list_routing_holds_and_the_order():
    reg = UpstreamRegistry(CFG)
    pool = reg.by_pool["mi"]
    assert [t.name for t in pool] == ["mi-0", "mi-1/dp0", "mi-1/dp1"]  # config dp_size splits at once
    reg.set_ranks("mi-0", 2, version="0.5.13.post1")
    assert reg.by_pool["mi"] is pool and [t.name for t in pool] == ["mi-0/dp0", "mi-0/dp1", "mi-1/dp0", "mi-1/dp1"]
    assert [t.name for t in reg.targets] == [t.name for t in pool]
    assert {t.version for t in pool[:2]} == {"0.5.13.post1"} and pool[0].breaker is not pool[1].breaker
    reg.set_ranks("mi-1", 1)  # discovery does not override the configured dp_size
    assert [t.dp_rank for t in pool] == [0, 1, 0, 1]
    assert set(reg.servers()) == {"mi-0", "mi-1"}


def test_draining_a_server_drains_its_ranks_and_pool_overrides_reach_new_ranks():
    reg = UpstreamRegistry(CFG)
    plane = ControlPlane(MemoryControlStore(), reg)
    reg.set_ranks("mi-0", 2)
    plane.apply(ControlState(drained=frozenset({"mi-1"}), pools={"mi": PoolOverride(weight=0.5)}))
    assert [(t.name, t.drained, t.weight) for t in reg.by_pool["mi"]] == [
        ("mi-0/dp0", False, 0.5), ("mi-0/dp1", False, 0.5), ("mi-1/dp0", True, 0.5), ("mi-1/dp1", True, 0.5)]
    plane.apply(ControlState(drained=frozenset({"mi-0/dp1"})))  # one rank alone, by its own name
    assert [t.drained for t in reg.by_pool["mi"]] == [False, True, False, False]


def test_release_parsing():
    assert release("0.5.13.post1") == (0, 5, 13) and release("0.5.9") < release("0.5.13") < release("0.5.23")
    assert release("") == () < (0, 5, 9)
