"""`gateway admin ...`: the on-call CLI over the admin API (the admin listener, default http://127.0.0.1:8081).

Tables by default, `-o json` for the API's JSON as is. The global flags (`--url`, `--token`, `--actor`, `-o`) are
accepted anywhere on the line (`gateway admin state -o json --url ...`); URL and token also from
GATEWAY_ADMIN_URL / GATEWAY_ADMIN_TOKEN. Times are shown in ISO 8601 UTC. Exits 1 with the API's error message on
failure, 2 on a usage error.

This module imports the standard library and httpx only — never the server (fastapi, the app, the config models):
a command starts in a fraction of a second (tests/test_admin_cli.py checks the imports)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gateway import admin_changes_cli

DEFAULT_URL = "http://127.0.0.1:8081"  # the admin listener next to a client port 8080


def _globals(p: argparse.ArgumentParser, top: bool) -> None:
    """The global flags, on the `admin` parser (`top`: with their defaults) and on every subcommand (defaults
    SUPPRESSed, so a flag given before the subcommand is not reset by the subcommand's parser)."""
    d: Callable[[Any], Any] = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--url", default=d(os.environ.get("GATEWAY_ADMIN_URL", DEFAULT_URL)),
                   help="the admin listener's base URL [GATEWAY_ADMIN_URL; default http://127.0.0.1:8081]")
    p.add_argument("--token", default=d(os.environ.get("GATEWAY_ADMIN_TOKEN")),
                   help="admin token [GATEWAY_ADMIN_TOKEN]")
    p.add_argument("--actor", default=d(os.environ.get("USER", "")), help="your name, for the audit log")
    p.add_argument("-o", "--output", choices=["table", "json"], default=d("table"),
                   help="table (default) or the API's JSON")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _globals(p, top=True)
    sub = p.add_subparsers(dest="admin_cmd", required=True)

    def cmd(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        _globals(sp, top=False)
        return sp

    cmd("state", "pools, replicas (health, breaker, load, predicted TTFT), overrides")
    for name in ("drain", "undrain", "flush"):
        sp = cmd(name, f"{name} a replica" if name != "flush" else "forget a replica's prefix entries")
        sp.add_argument("replica")
    sp = cmd("pool", "set or clear a pool's weight / per-token price")
    sp.add_argument("pool")
    sp.add_argument("--weight", type=float)
    sp.add_argument("--price", nargs=3, type=float, metavar=("IN", "CACHED_IN", "OUT"), help="$/Mtok")
    sp.add_argument("--clear", action="store_true")
    sp.add_argument("--preview", action="store_true", help="say what recent decisions --weight would move; change nothing")
    sp = cmd("override", "temporary tenant override (SLA, pin to a pool, ...)")
    sp.add_argument("tenant")
    sp.add_argument("--ttl", type=float, default=3600.0, help="seconds until it lapses (default 1 h)")
    sp.add_argument("--sla-ms", type=float)
    sp.add_argument("--pin")
    sp.add_argument("--objective", choices=["cost", "latency"])
    sp.add_argument("--on-sla-miss", choices=["spill", "shed"])
    sp.add_argument("--flow-band", help="flow control band (one of the config's flow.bands)")
    sp.add_argument("--flow-weight", type=float, help="flow control weight within its band")
    sp.add_argument("--clear", action="store_true")
    sp.add_argument("--preview", action="store_true", help="say what recent decisions --pin would move; change nothing")
    sp = cmd("decisions", "recent routing decisions on that instance")
    sp.add_argument("--limit", type=int, default=20)
    sp.add_argument("--tenant")
    sp = cmd("explain", "dry-run routing for a tenant's request")
    sp.add_argument("--tenant", required=True)
    sp.add_argument("--model", required=True)
    sp.add_argument("--prompt", help="user message text (or --request-file with a full OpenAI body)")
    sp.add_argument("--request-file")
    cmd("reload", "reload tenant policies on every instance")
    cmd("policies", "policy status")
    sp = cmd("audit", "audit log, newest first")
    sp.add_argument("--limit", type=int, default=50)
    sp = cmd("usage", "usage and cost per tenant")
    sp.add_argument("--tenant")
    sp = cmd("recording", "that instance's traffic recording for gateway replay: status, start, stop")
    sp.add_argument("action", nargs="?", choices=["status", "start", "stop"], default="status")
    before = set(sub.choices)
    admin_changes_cli.add_parsers(sub)  # tenant, history, undo
    for name in set(sub.choices) - before:
        _globals(sub.choices[name], top=False)


def _request(a: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, Any]]:
    live = admin_changes_cli.request(a)
    if live is not None:
        return live
    c = a.admin_cmd
    if c == "state":
        return "GET", "/admin/state", None, {}
    if c in ("drain", "undrain"):
        return "POST", f"/admin/replicas/{a.replica}/{c}", None, {}
    if c == "flush":
        return "POST", f"/admin/replicas/{a.replica}/flush-prefix", None, {}
    if c == "pool":
        if a.clear:
            return "DELETE", f"/admin/pools/{a.pool}", None, {}
        body: dict[str, Any] = {}
        if a.weight is not None:
            body["weight"] = a.weight
        if a.price:
            body["pricing"] = {"type": "per_token", "input_per_mtok": a.price[0], "cached_input_per_mtok": a.price[1],
                               "output_per_mtok": a.price[2]}
        return "PUT", f"/admin/pools/{a.pool}", body, {}
    if c == "override":
        if a.clear:
            return "DELETE", f"/admin/tenants/{a.tenant}/override", None, {}
        body = {"ttl_s": a.ttl, "ttft_sla_ms": a.sla_ms, "pin_pool": a.pin, "objective": a.objective,
                "on_sla_miss": a.on_sla_miss, "flow_band": a.flow_band, "flow_weight": a.flow_weight}
        return "PUT", f"/admin/tenants/{a.tenant}/override", {k: v for k, v in body.items() if v is not None}, {}
    if c == "decisions":
        return "GET", "/admin/decisions", None, {k: v for k, v in (("limit", a.limit), ("tenant", a.tenant)) if v}
    if c == "explain":
        if a.request_file:
            with open(a.request_file) as f:
                req = json.load(f)
        else:
            req = {"messages": [{"role": "user", "content": a.prompt or ""}]}
        req["model"] = a.model
        return "POST", "/admin/explain", {"tenant": a.tenant, "request": req}, {}
    if c == "reload":
        return "POST", "/admin/policies/reload", None, {}
    if c == "policies":
        return "GET", "/admin/policies", None, {}
    if c == "audit":
        return "GET", "/admin/audit", None, {"limit": a.limit}
    if c == "recording":
        if a.action == "status":
            return "GET", "/admin/recording", None, {}
        return "POST", f"/admin/recording/{a.action}", None, {}
    assert c == "usage"
    return "GET", "/admin/usage", None, {"tenant": a.tenant} if a.tenant else {}


def run(a: argparse.Namespace) -> int:
    if not a.token:
        print("admin: no token (--token or GATEWAY_ADMIN_TOKEN)", file=sys.stderr)
        return 2
    import httpx  # here, not at the top: `gateway admin -h` needs no HTTP client

    method, path, body, params = _request(a)
    headers = {"authorization": f"Bearer {a.token}", "x-admin-actor": a.actor}
    try:
        r = httpx.request(method, a.url.rstrip("/") + path, json=body, params=params, headers=headers, timeout=10,
                          trust_env=False)
    except httpx.HTTPError as e:
        print(f"admin: cannot reach {a.url}: {e}", file=sys.stderr)
        return 1
    try:
        data = r.json()
    except ValueError:
        data = {"raw": r.text}
    if r.status_code >= 400:
        msg = data.get("error", {}).get("message") if isinstance(data.get("error"), dict) else data
        print(f"admin: {r.status_code}: {msg}", file=sys.stderr)
        if r.status_code == 404 and "Unknown path" in str(msg):
            print(f"admin: is {a.url} the admin listener? (the client port serves no /admin)", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if a.output == "json" else render(a.admin_cmd, data))
    return 0


# -- tables ---------------------------------------------------------------------------------------------------------
def iso(t: Any) -> str:
    """Epoch seconds as ISO 8601 UTC (to the second); anything else as is."""
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 1e9:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    return cell(t)


def cell(v: Any, width: int = 48) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return s if len(s) <= width else s[: width - 1] + "…"


def table(rows: list[dict[str, Any]], columns: list[tuple[str, Callable[[dict[str, Any]], str]]]) -> str:
    if not rows:
        return "(none)"
    cells = [[h for h, _ in columns]] + [[f(r) for _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def col(key: str, fmt: Callable[[Any], str] = cell) -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt(r.get(key))


def _is_time(key: str) -> bool:
    return key == "at" or key.endswith("_at")


HIDDEN = {"undo"}  # an audit entry's inverse change: for the API's undo, not for reading (-o json shows it)


def auto_table(rows: list[dict[str, Any]]) -> str:
    """Columns: the rows' keys in first-seen order; times as ISO."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and k not in HIDDEN]
    return table(rows, [(k.upper(), col(k, iso if _is_time(k) else cell)) for k in keys])


def key_values(data: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += key_values(v, name + ".")
        else:
            out.append((name, iso(v) if _is_time(k) else cell(v, 100)))
    return out


def kv_block(data: dict[str, Any]) -> str:
    pairs = key_values(data)
    w = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in pairs)


def render_state(d: dict[str, Any]) -> str:
    reps = [{**r, "pool": p["name"]} for p in d.get("pools", []) for r in p.get("replicas", [])]
    pools = table(d.get("pools", []), [("POOL", col("name")), ("KIND", col("kind")), ("WEIGHT", col("weight")),
                                       ("REPLICAS", lambda p: str(len(p.get("replicas", []))))])
    replicas = table(reps, [
        ("REPLICA", col("name")), ("POOL", col("pool")), ("HEALTHY", col("healthy")), ("BREAKER", col("circuit")),
        ("DRAINED", col("drained")), ("ROUTABLE", col("routable")), ("INFLIGHT", col("inflight")),
        ("QUEUED_PREFILL", col("queued_prefill_tokens")), ("PRED_TTFT_S", col("predicted_ttft_s")),
        ("LAST_ERROR", lambda r: cell(r.get("last_error") or None, 40))])
    overrides = [{"kind": "tenant", "name": k, **v} for k, v in (d.get("tenant_overrides") or {}).items()] + \
                [{"kind": "pool", "name": k, **v} for k, v in (d.get("pool_overrides") or {}).items()]
    pol = d.get("policies") or {}
    lines = [pools, "", replicas, "", "OVERRIDES", auto_table(overrides) if overrides else "(none)", "",
             f"prefix index entries: {d.get('prefix_index_entries')}   control applied: "
             f"{iso(d.get('control_applied_at'))}   policies: {pol.get('tenants')} tenants, loaded "
             f"{iso(pol.get('loaded_at'))}, last error: {cell(pol.get('last_error'), 200)}"]
    return "\n".join(lines)


def render_decisions(d: dict[str, Any]) -> str:
    rows = d.get("decisions", [])
    return table(rows, [("AT", col("at", iso)), ("REQUEST_ID", col("request_id")), ("TENANT", col("tenant")),
                        ("MODEL", col("model")), ("STATUS", col("status")), ("SERVED_BY", col("served_by")),
                        ("ATTEMPTS", col("attempts")),
                        ("ROUTE", lambda r: cell((r.get("decision") or {}).get("branch")))])


def render_usage(d: dict[str, Any]) -> str:
    rows = []
    for name, u in (d.get("tenants") or {}).items():
        day, month, budget = u.get("day") or {}, u.get("month") or {}, u.get("budget") or {}
        rows.append({"tenant": name, "day_requests": day.get("requests"), "day_usd": day.get("spent_usd"),
                     "day_cap": budget.get("usd_per_day"), "month_usd": month.get("spent_usd"),
                     "month_cap": budget.get("usd_per_month")})
    return auto_table(rows)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def change_text(e: dict[str, Any]) -> str:
    """`field: before -> after` for every field an audit entry changed (nested fields dotted)."""
    if "before" not in e and "after" not in e:
        return ""
    b, a = _flat(e.get("before") or {}), _flat(e.get("after") or {})
    keys = [k for k in dict.fromkeys([*b, *a]) if b.get(k) != a.get(k)]
    return "; ".join(f"{k}: {cell(b.get(k), 24)} -> {cell(a.get(k), 24)}" for k in keys) or "(no change)"


def render_history(d: dict[str, Any]) -> str:
    def target(e: dict[str, Any]) -> str:
        return cell(e.get("replica") or e.get("pool") or e.get("tenant") or e.get("path"))

    def state(e: dict[str, Any]) -> str:
        if e.get("undo_of"):
            return f"undoes #{e['undo_of']}"
        if e.get("undone_by"):
            return f"undone by #{e['undone_by']}"
        return "undoable" if e.get("undoable") else ""

    return table(d.get("entries", []), [("ID", col("id")), ("AT", col("at", iso)), ("WHO", col("who")),
                                        ("WHAT", col("what")), ("TARGET", target), ("", state),
                                        ("CHANGE", lambda e: change_text(e)[:200])])


def render(command: str, data: dict[str, Any]) -> str:
    """A table for the command's answer: lists of records as columns, everything else as `key  value` lines."""
    if command == "state":
        return render_state(data)
    if command in ("history", "audit"):
        return render_history(data)
    if command == "decisions":
        return render_decisions(data)
    if command == "usage":
        return render_usage(data)
    lists = [k for k, v in data.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    if len(lists) == 1:
        rest = {k: v for k, v in data.items() if k != lists[0]}
        return auto_table(data[lists[0]]) + (("\n\n" + kv_block(rest)) if rest else "")
    return kv_block(data) if data else "(empty)"
