"""Tenant policies: files merge over defaults, every error names the file and the field, the shipped schemas and
examples are current, and the derived values (cache namespace, priority) follow one rule."""

import dataclasses
from pathlib import Path

import pytest

from gateway.config import hash_key, load_config, parse_config
from gateway.dispatch.upstream_body import adapt_body
from gateway.policy_schema import Tenant
from gateway.routing.engine import prefill_level
from gateway.tenancy.policy_loader import PolicyError, load_policies
from gateway.tenancy.schema_cli import schemas
from gateway.upstreams import UpstreamRegistry

ROOT = Path(__file__).resolve().parents[2]
KEY_HASH = hash_key("sk-unit")
CFG = parse_config({
    "models": [{"name": "glm-5.2", "pools": ["mi", "hosted"]}],
    "pools": [{"name": "mi", "kind": "sglang", "model": "m", "replicas": [{"name": "mi-0", "url": "http://127.0.0.1:1"}]},
              {"name": "hosted", "kind": "openai", "model": "m", "base_url": "http://127.0.0.1:2/v1"}],
    "policies": {"dir": "/nonexistent"},
})


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_shipped_examples_load_and_merge_over_defaults():
    cfg = load_config(ROOT / "deploy" / "gateway.multi-tenant.yaml")
    ps = load_policies(cfg.policies.dir, cfg)
    t = {x.name: x for x in ps.tenants}
    assert set(t) == {"acme", "batch-jobs"}
    # acme: its own token limit plus the defaults' request limit (nested sections merge by key)
    assert t["acme"].rate_limits.requests_per_minute == 600 and t["acme"].rate_limits.tokens_per_minute == 2_000_000
    assert t["acme"].ttft_sla_ms == 1500 and t["acme"].on_sla_miss == "spill"  # own value; default
    assert t["batch-jobs"].rate_limits.requests_per_minute == 120 and t["batch-jobs"].on_sla_miss == "shed"
    assert t["batch-jobs"].cache.isolated  # from defaults


def test_shipped_json_schemas_are_current():
    """Editors validate against policies/*.schema.json: regenerate with `gateway policies schema` when models change."""
    for name, text in schemas().items():
        assert (ROOT / "policies" / name).read_text() == text, f"policies/{name} is stale: run `gateway policies schema`"


OK_TENANT = f"api_key_hashes: [{KEY_HASH}]\nmodels: [glm-5.2]\n"


@pytest.mark.parametrize("files, message", [
    ({"tenants/a.yaml": OK_TENANT + "rate_limits: {requests_per_minute: 0}\n"},
     "tenants/a.yaml: rate_limits.requests_per_minute: Input should be greater than or equal to 1"),
    ({"tenants/a.yaml": OK_TENANT + "colour: blue\n"}, "tenants/a.yaml: colour: Extra inputs are not permitted"),
    ({"tenants/a.yaml": f"api_key_hashes: [{KEY_HASH}]\nmodels: [gpt-9]\n"}, "tenants/a.yaml: models[0]: unknown model 'gpt-9'"),
    ({"tenants/a.yaml": OK_TENANT + "pools: [elsewhere]\n"}, "tenants/a.yaml: pools[0]: unknown pool 'elsewhere'"),
    ({"tenants/a.yaml": "api_key_hashes: [sk-raw-key]\nmodels: [glm-5.2]\n"}, "tenants/a.yaml: api_key_hashes: Value error"),
    ({"tenants/a.yaml": OK_TENANT + "name: b\n"}, "tenants/a.yaml: name: must match the file name ('a')"),
    ({"tenants/a.yaml": OK_TENANT, "tenants/b.yaml": OK_TENANT}, "tenants/b.yaml: api_key_hashes: key already belongs to tenant 'a'"),
    ({"tenants/a.yaml": "models: [glm-5.2\n"}, "tenants/a.yaml: invalid YAML"),
    ({"tenants/a.yaml": OK_TENANT, "defaults.yaml": "budget: {usd_per_day: -1}\n"},
     "defaults.yaml: budget.usd_per_day: Input should be greater than 0"),
    ({"defaults.yaml": "objective: cost\n"}, "no tenant files under tenants/"),
])
def test_errors_name_the_file_and_the_field(tmp_path, files, message):
    with pytest.raises(PolicyError) as e:
        load_policies(write(tmp_path, files), CFG)
    assert message in str(e.value)


def test_tenant_value_wins_and_lists_replace(tmp_path):
    root = write(tmp_path, {"defaults.yaml": "models: [glm-5.2]\npools: [mi, hosted]\nbudget: {usd_per_day: 5, usd_per_month: 50}\n",
                            "tenants/a.yaml": f"api_key_hashes: [{KEY_HASH}]\npools: [mi]\nbudget: {{usd_per_day: 1}}\n"})
    t = load_policies(root, CFG).tenants[0]
    assert t.pools == ["mi"] and t.models == ["glm-5.2"]
    assert t.budget.usd_per_day == 1 and t.budget.usd_per_month == 50


def tenant(**kw) -> Tenant:
    return Tenant(name=kw.pop("name", "a"), api_key_hashes=[KEY_HASH], models=["glm-5.2"], **kw)


def test_cache_namespaces_isolate_by_default_and_share_only_by_group():
    assert tenant(name="a").cache_namespace() != tenant(name="b").cache_namespace()
    g = {"sharing_group": "team"}
    assert tenant(name="a", cache=g).cache_namespace() == tenant(name="b", cache=g).cache_namespace() == "group:team"
    assert tenant(name="a", cache={"isolated": False}).cache_namespace() == "shared"
    # a client's own salt subdivides its tenant's namespace, never escapes it
    assert tenant(name="a").cache_namespace("x") == "tenant:a:x"


def test_priority_comes_from_the_policy_never_the_client():
    reg = UpstreamRegistry(CFG)
    mi, hosted = reg.by_pool["mi"][0], reg.by_pool["hosted"][0]
    mi.state.priority_scheduling = True  # as the preflight reads it from /server_info
    body = {"model": "glm-5.2", "messages": [], "priority": 99, "cache_salt": "x"}
    high = adapt_body(body, mi, False, tenant(priority="high"))
    assert high["priority"] == 10 and high["cache_salt"] == "tenant:a:x" and high["model"] == "m"
    out = adapt_body(body, hosted, False, tenant(priority="high"))
    assert "priority" not in out and out["cache_salt"] == "x"  # hosted endpoints get neither


def test_priority_is_explicit_for_every_class_on_servers_that_schedule_by_it():
    """Normal is sent as 0, not left out: SGLang would give a request without one the lowest value (or the
    server's --default-priority-value), ranking normal below low."""
    reg = UpstreamRegistry(CFG)
    mi = reg.by_pool["mi"][0]
    body = {"model": "glm-5.2", "messages": []}
    mi.state.priority_scheduling = True
    assert [adapt_body(body, mi, False, tenant(priority=p))["priority"] for p in ("high", "normal", "low")] == [10, 0, -10]
    # a server without priority scheduling (or not yet inspected) gets none: --abort-on-priority-when-disabled
    # would refuse every request that carries one
    for known in (False, None):
        mi.state.priority_scheduling = known
        assert "priority" not in adapt_body({**body, "priority": 5}, mi, False, tenant(priority="high"))
    mi.state.priority_scheduling = True
    mi.state.low_priority_values_first = True  # --schedule-low-priority-values-first: the server reads the scale upside down
    assert [adapt_body(body, mi, False, tenant(priority=p))["priority"] for p in ("high", "normal", "low")] == [-10, 0, 10]
    mi.state.low_priority_values_first = False
    mi = dataclasses.replace(mi, send_priority="always")  # the pool's setting (a rank's copy shares its state)
    mi.state.priority_scheduling = None
    assert adapt_body(body, mi, False, tenant(priority="normal"))["priority"] == 0
    mi = dataclasses.replace(mi, send_priority="never")
    mi.state.priority_scheduling = True
    assert "priority" not in adapt_body(body, mi, False, tenant(priority="high"))


def test_prefill_levels_order_a_class_by_its_uncached_tokens_and_never_cross_classes():
    """routing.shortest_prefill_first: class value + 9 for <= 256 uncached tokens, one less per doubling, 0 from 128k.
    The levels span 9, under the classes' spacing (10) and SGLang's preemption threshold (more than 10): a long
    high request still ranks above a short normal one, and two requests of one class never preempt each other."""
    assert [prefill_level(u) for u in (1, 256, 257, 512, 513, 2048, 20_000, 131_072, 10**6)] == [9, 9, 8, 8, 7, 6, 2, 0, 0]
    reg = UpstreamRegistry(CFG)
    mi = reg.by_pool["mi"][0]
    mi.state.priority_scheduling = True
    body = {"model": "glm-5.2", "messages": []}

    def sent(klass: str, uncached: int | None) -> int:
        level = 0 if uncached is None else prefill_level(uncached)
        return int(adapt_body(body, mi, False, tenant(priority=klass), level)["priority"])

    assert sent("normal", 100) == 9 and sent("normal", 20_000) == 2 and sent("normal", None) == 0
    assert sent("high", 10**6) > sent("normal", 1) and sent("normal", 10**6) > sent("low", 1)
    mi.state.low_priority_values_first = True  # the server reads the scale upside down: so is the level
    assert sent("normal", 100) == -9 and sent("high", 10**6) < sent("normal", 1)
    hosted = reg.by_pool["hosted"][0]
    assert "priority" not in adapt_body(body, hosted, False, tenant(priority="normal"), 9)


def test_priority_mapping_is_per_pool():
    cfg = parse_config({**CFG.model_dump(exclude_none=True, exclude={"pools"}), "pools": [
        {"name": "mi", "kind": "sglang", "model": "m", "priority_values": {"high": 100, "low": 1},
         "send_priority": "always", "replicas": [{"name": "mi-0", "url": "http://127.0.0.1:1"}]},
        {"name": "hosted", "kind": "openai", "model": "m", "base_url": "http://127.0.0.1:2/v1"}]})
    mi = UpstreamRegistry(cfg).by_pool["mi"][0]
    got = [adapt_body({"messages": []}, mi, False, tenant(priority=p))["priority"] for p in ("high", "normal", "low")]
    assert got == [100, 0, 1]  # unset classes keep the default mapping


def test_dp_rank_targets_pin_the_rank_the_router_chose():
    """A server split into rank targets: each carries its rank in the field its release understands, and a
    client's own pin is replaced (the router chooses the rank, as it chooses the replica)."""
    reg = UpstreamRegistry(CFG)
    ranks = reg.set_ranks("mi-0", 2)
    assert [t.name for t in reg.by_pool["mi"]] == ["mi-0/dp0", "mi-0/dp1"] and ranks == reg.by_pool["mi"]
    body = {"messages": [], "data_parallel_rank": 0, "routed_dp_rank": 0}
    old = adapt_body(body, ranks[1], False)  # version unknown: the field every release accepts
    assert old["data_parallel_rank"] == 1 and "routed_dp_rank" not in old
    ranks[1].state.version = "0.5.23"
    new = adapt_body(body, ranks[1], False)
    assert new["routed_dp_rank"] == 1 and "data_parallel_rank" not in new
    header = dataclasses.replace(ranks[1], dp_pinning="header")  # a pool with `dp_pinning: header`
    assert "routed_dp_rank" not in adapt_body(body, header, False)
    assert header.pin_headers() == {"X-Data-Parallel-Rank": "1"}
    assert reg.set_ranks("mi-0", 1)[0].name == "mi-0" and len(reg.targets) == 2  # merged back; hosted kept
    assert reg.get("mi-0") is reg.by_pool["mi"][0]
