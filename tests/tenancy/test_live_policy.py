"""Live policy changes laid over a tenant file (pure): the same merge rules and the same validation as a policy file,
errors that name the field, and identity fields kept out of reach."""

import pytest

from gateway.config import hash_key, parse_config
from gateway.policy_schema import Tenant
from gateway.tenancy.live_policy import LivePolicyError, apply, combine, diff, view

CFG = parse_config({
    "models": [{"name": "glm-5.2", "pools": ["mi"]}],
    "pools": [{"name": "mi", "kind": "sglang", "model": "m", "replicas": [{"name": "mi-0", "url": "http://127.0.0.1:1"}]}],
    "tenants": [{"name": "t", "api_key_hashes": [hash_key("k")], "models": ["glm-5.2"]}],
})
BASE = Tenant(name="acme", api_key_hashes=[hash_key("k")], models=["glm-5.2"],
              rate_limits={"requests_per_minute": 60, "tokens_per_minute": 1000}, budget={"usd_per_day": 10})


def test_nested_sections_merge_by_key_and_null_clears():
    fields = combine({"rate_limits": {"requests_per_minute": 600}}, {"rate_limits": {"tokens_per_minute": None}})
    t = apply(CFG, BASE, fields)
    assert t.rate_limits.requests_per_minute == 600 and t.rate_limits.tokens_per_minute is None
    assert t.budget.usd_per_day == 10 and t.api_key_hashes == BASE.api_key_hashes  # untouched fields stay
    assert diff(view(BASE), view(t)) == {"rate_limits": [{"requests_per_minute": 60, "tokens_per_minute": 1000},
                                                         {"requests_per_minute": 600, "tokens_per_minute": None}]}


def test_no_fields_is_the_file_tenant_itself():
    assert apply(CFG, BASE, {}) is BASE


@pytest.mark.parametrize("fields, where", [
    ({"rate_limits": {"requests_per_minute": 0}}, "rate_limits.requests_per_minute"),
    ({"rate_limits": {"requests_per_minute": 6_000_000_000_000}}, "rate_limits.requests_per_minute"),  # a typo
    ({"ttft_sla_ms": 1e9}, "ttft_sla_ms"),
    ({"budget": {"usd_per_month": 0}}, "budget.usd_per_month"),
    ({"rate_limits": {"per_hour": 5}}, "rate_limits.per_hour"),
    ({"pools": ["gpu-z"]}, "pools[0]"),
    ({"model_aliases": [{"match": "claude-*", "model": "other"}]}, "model_aliases[0].model"),
    ({"max_concurrent_scope": "fleet"}, "max_concurrent_scope"),  # needs Redis, as in a policy file
])
def test_invalid_changes_name_the_field(fields, where):
    with pytest.raises(LivePolicyError) as e:
        apply(CFG, BASE, combine({}, fields))
    assert e.value.field == where


@pytest.mark.parametrize("field", ["api_key_hashes", "models", "name", "cache", "colour"])
def test_identity_entitlements_and_unknown_fields_are_not_live(field):
    with pytest.raises(LivePolicyError) as e:
        combine({}, {field: "x"})
    assert e.value.field == field and "editable" in str(e.value)
