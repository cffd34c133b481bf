"""`gateway admin ...`: the on-call CLI over the admin API. URL and token from flags or GATEWAY_ADMIN_URL /
GATEWAY_ADMIN_TOKEN; prints the API's JSON; exits 1 with the API's error message on failure."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from gateway import admin_changes_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("GATEWAY_ADMIN_URL", "http://127.0.0.1:8081"),
                   help="the admin listener's base URL [GATEWAY_ADMIN_URL]")
    p.add_argument("--token", default=os.environ.get("GATEWAY_ADMIN_TOKEN"), help="admin token [GATEWAY_ADMIN_TOKEN]")
    p.add_argument("--actor", default=os.environ.get("USER", ""), help="your name, for the audit log")
    sub = p.add_subparsers(dest="admin_cmd", required=True)
    sub.add_parser("state", help="pools, replicas, load, predicted TTFT, overrides")
    for name in ("drain", "undrain", "flush"):
        sp = sub.add_parser(name, help=f"{name} a replica" if name != "flush" else "forget a replica's prefix entries")
        sp.add_argument("replica")
    sp = sub.add_parser("pool", help="set or clear a pool's weight / per-token price")
    sp.add_argument("pool")
    sp.add_argument("--weight", type=float)
    sp.add_argument("--price", nargs=3, type=float, metavar=("IN", "CACHED_IN", "OUT"), help="$/Mtok")
    sp.add_argument("--clear", action="store_true")
    sp.add_argument("--preview", action="store_true", help="say what recent decisions --weight would move; change nothing")
    sp = sub.add_parser("override", help="temporary tenant override (SLA, pin to a pool, ...)")
    sp.add_argument("tenant")
    sp.add_argument("--ttl", type=float, default=3600.0, help="seconds until it lapses (default 1 h)")
    sp.add_argument("--sla-ms", type=float)
    sp.add_argument("--pin")
    sp.add_argument("--objective", choices=["cost", "latency"])
    sp.add_argument("--on-sla-miss", choices=["spill", "shed"])
    sp.add_argument("--clear", action="store_true")
    sp.add_argument("--preview", action="store_true", help="say what recent decisions --pin would move; change nothing")
    sp = sub.add_parser("decisions", help="recent routing decisions on that instance")
    sp.add_argument("--limit", type=int, default=20)
    sp.add_argument("--tenant")
    sp = sub.add_parser("explain", help="dry-run routing for a tenant's request")
    sp.add_argument("--tenant", required=True)
    sp.add_argument("--model", required=True)
    sp.add_argument("--prompt", help="user message text (or --request-file with a full OpenAI body)")
    sp.add_argument("--request-file")
    sub.add_parser("reload", help="reload tenant policies on every instance")
    sub.add_parser("policies", help="policy status")
    sp = sub.add_parser("audit", help="audit log, newest first")
    sp.add_argument("--limit", type=int, default=50)
    sp = sub.add_parser("usage", help="usage and cost per tenant")
    sp.add_argument("--tenant")
    sp = sub.add_parser("recording", help="that instance's traffic recording for gateway replay: status, start, stop")
    sp.add_argument("action", nargs="?", choices=["status", "start", "stop"], default="status")
    admin_changes_cli.add_parsers(sub)


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
                "on_sla_miss": a.on_sla_miss}
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
        return 1
    print(json.dumps(data, indent=2))
    return 0
