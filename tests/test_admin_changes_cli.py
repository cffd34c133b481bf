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


def test_history_reads_as_one_line_per_change_with_what_it_changed():
    entries = [
        {"id": 3, "at": 1.8e9, "who": "token:ab (bo)", "what": "undrain", "replica": "p-1", "undo_of": 2,
         "undoable": True, "before": {"drained": True}, "after": {"drained": False}},
        {"id": 2, "at": 1.8e9, "who": "token:ab (al)", "what": "tenant_policy", "tenant": "acme", "undoable": True,
         "before": {"rate_limits": {"requests_per_minute": 60, "tokens_per_minute": None}},
         "after": {"rate_limits": {"requests_per_minute": 600, "tokens_per_minute": None}}, "undo": {"kind": "x"}},
        {"id": 1, "at": 1.8e9, "who": "policy-file", "what": "policy_reload", "undoable": False,
         "before": {"acme": {"priority": "low"}}, "after": {"acme": {"priority": "high"}}},
    ]
    lines = admin_cli.render("history", {"entries": entries}).splitlines()
    assert lines[0].split() == ["ID", "AT", "WHO", "WHAT", "TARGET", "CHANGE"]
    assert "undoes #2" in lines[1] and "drained: yes -> no" in lines[1]
    assert "acme" in lines[2] and "rate_limits.requests_per_minute: 60 -> 600" in lines[2]
    assert "tokens_per_minute" not in lines[2]  # unchanged fields are left out
    assert "acme.priority: low -> high" in lines[3]
