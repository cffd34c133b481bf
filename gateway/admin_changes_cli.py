"""`gateway admin tenant|history|undo` and `--preview` on `pool` / `override`: the CLI side of live tenant changes,
the change history and undo (gateway/api/admin/changes.py). Each command maps to one admin API call."""

from __future__ import annotations

import argparse
import json
from typing import Any

CLEAR = "none"  # a limit flag given as `none`: clear that limit (null in the change)


def _limit(v: str) -> int | str:
    """A limit's value: a positive integer, or `none` to clear it."""
    return CLEAR if v.lower() in ("none", "null", "off") else int(v)


def _amount(v: str) -> float | str:
    return CLEAR if v.lower() in ("none", "null", "off") else float(v)


def _value(v: Any) -> Any:
    return None if v == CLEAR else v


def add_parsers(sub: Any) -> None:
    sp = sub.add_parser("tenant", help="show a tenant's policy, or change it live on every instance (audited, undoable)")
    sp.add_argument("tenant")
    sp.add_argument("--rpm", type=_limit, help="requests per minute (`none`: no limit)")
    sp.add_argument("--tpm", type=_limit, help="tokens per minute (`none`: no limit)")
    sp.add_argument("--max-concurrent", type=_limit)
    sp.add_argument("--budget-day", type=_amount, help="USD per UTC day (`none`: no cap)")
    sp.add_argument("--budget-month", type=_amount, help="USD per calendar month (`none`: no cap)")
    sp.add_argument("--sla-ms", type=_amount, help="TTFT SLA in ms")
    sp.add_argument("--priority", choices=["high", "normal", "low"])
    sp.add_argument("--alias", action="append", metavar="MATCH=MODEL", help="model alias (repeat; replaces the list)")
    sp.add_argument("--no-aliases", action="store_true", help="remove every model alias")
    sp.add_argument("--pools", help="comma-separated pools it may be served by (`none`: every pool of its models)")
    sp.add_argument("--set", dest="set_json", metavar="JSON", help='any editable fields as JSON, e.g. \'{"objective": "latency"}\'')
    sp.add_argument("--if-version", type=int, help="refuse (409) if its live change moved past this version")
    sp.add_argument("--clear", action="store_true", help="drop the live change: the policy file's values serve again")
    sp = sub.add_parser("history", help="changes, newest first, with before / after and whether each can be undone")
    sp.add_argument("--limit", type=int, default=30)
    sp = sub.add_parser("undo", help="undo a change (default: the newest not yet undone)")
    sp.add_argument("id", nargs="?", type=int)


def tenant_change(a: argparse.Namespace) -> dict[str, Any]:
    """The partial policy the flags describe (only what was given)."""
    change: dict[str, Any] = json.loads(a.set_json) if a.set_json else {}
    for section, pairs in (("rate_limits", (("requests_per_minute", a.rpm), ("tokens_per_minute", a.tpm))),
                           ("budget", (("usd_per_day", a.budget_day), ("usd_per_month", a.budget_month)))):
        given = {k: _value(v) for k, v in pairs if v is not None}
        if given:
            change[section] = given
    if a.max_concurrent is not None:
        change["max_concurrent"] = _value(a.max_concurrent)
    if a.sla_ms is not None:
        change["ttft_sla_ms"] = _value(a.sla_ms)
    if a.priority:
        change["priority"] = a.priority
    if a.no_aliases:
        change["model_aliases"] = []
    elif a.alias:
        change["model_aliases"] = [{"match": m, "model": t} for m, _, t in (x.partition("=") for x in a.alias)]
    if a.pools is not None:
        change["pools"] = None if a.pools.lower() == "none" else [p for p in a.pools.split(",") if p]
    return change


def request(a: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, Any]] | None:
    c = a.admin_cmd
    if c == "tenant":
        path = f"/admin/tenants/{a.tenant}/policy"
        params = {"if_version": a.if_version} if a.if_version is not None else {}
        if a.clear:
            return "DELETE", path, None, params
        change = tenant_change(a)
        return ("PATCH", path, change, params) if change else ("GET", path, None, {})
    if c == "history":
        return "GET", "/admin/history", None, {"limit": a.limit}
    if c == "undo":
        return "POST", "/admin/undo", {"id": a.id} if a.id is not None else {}, {}
    if c == "pool" and getattr(a, "preview", False):
        return "POST", "/admin/preview", {"pool": a.pool, "weight": a.weight}, {}
    if c == "override" and getattr(a, "preview", False):
        return "POST", "/admin/preview", {"tenant": a.tenant, "pin_pool": a.pin}, {}
    return None
