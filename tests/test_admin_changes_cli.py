"""`gateway admin tenant|history|undo` and `--preview` map their flags to one admin API call each (pure: parsed, not
sent): only the flags given end up in the change, `none` clears a limit, a preview never writes."""

import argparse

import pytest

from gateway import admin_cli
from gateway.admin_changes_cli import request


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    admin_cli.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv, want", [
    (["tenant", "acme"], ("GET", "/admin/tenants/acme/policy", None, {})),
    (["tenant", "acme", "--rpm", "600"],
     ("PATCH", "/admin/tenants/acme/policy", {"rate_limits": {"requests_per_minute": 600}}, {})),
    (["tenant", "acme", "--tpm", "none", "--budget-day", "25.5", "--priority", "high", "--if-version", "3"],
     ("PATCH", "/admin/tenants/acme/policy", {"rate_limits": {"tokens_per_minute": None},
                                              "budget": {"usd_per_day": 25.5}, "priority": "high"}, {"if_version": 3})),
    (["tenant", "acme", "--alias", "claude-*=glm-5.2", "--pools", "mi,b200", "--max-concurrent", "none"],
     ("PATCH", "/admin/tenants/acme/policy", {"max_concurrent": None, "pools": ["mi", "b200"],
                                              "model_aliases": [{"match": "claude-*", "model": "glm-5.2"}]}, {})),
    (["tenant", "acme", "--set", '{"objective": "latency"}'],
     ("PATCH", "/admin/tenants/acme/policy", {"objective": "latency"}, {})),
    (["tenant", "acme", "--clear"], ("DELETE", "/admin/tenants/acme/policy", None, {})),
    (["history", "--limit", "5"], ("GET", "/admin/history", None, {"limit": 5})),
    (["undo"], ("POST", "/admin/undo", {}, {})),
    (["undo", "42"], ("POST", "/admin/undo", {"id": 42}, {})),
    (["pool", "b200", "--weight", "0.5", "--preview"], ("POST", "/admin/preview", {"pool": "b200", "weight": 0.5}, {})),
    (["override", "acme", "--pin", "mi", "--preview"],
     ("POST", "/admin/preview", {"tenant": "acme", "pin_pool": "mi"}, {})),
])
def test_flags_map_to_one_call(argv, want):
    assert request(parse(*argv)) == want


def test_without_preview_the_existing_commands_are_untouched():
    assert request(parse("pool", "b200", "--weight", "0.5")) is None  # admin_cli's own PUT
    assert request(parse("drain", "r0")) is None
