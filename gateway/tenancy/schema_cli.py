"""`gateway policies schema [--out DIR]` writes the JSON Schemas of policy files (for editors: yaml-language-server
reads the `# yaml-language-server: $schema=...` line at the top of each file); `gateway policies check --config F`
validates a policy directory against a gateway config without starting anything (for CI and pre-commit)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from gateway.config import ConfigError, load_config
from gateway.policy_schema import PolicyDefaults, TenantFile
from gateway.tenancy.policy_loader import load_policies

SCHEMAS: dict[str, type[BaseModel]] = {"tenant.schema.json": TenantFile, "defaults.schema.json": PolicyDefaults}


def schemas() -> dict[str, str]:
    return {name: json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n" for name, model in SCHEMAS.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="policies_cmd", required=True)
    sp = sub.add_parser("schema", help="write the policy files' JSON Schemas")
    sp.add_argument("--out", default="policies", help="directory (default: policies)")
    sp = sub.add_parser("check", help="validate a policy directory against a gateway config")
    sp.add_argument("--config", required=True)
    sp.add_argument("--dir", help="policy directory (default: the config's policies.dir)")


def run(a: argparse.Namespace) -> int:
    if a.policies_cmd == "schema":
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in schemas().items():
            (out / name).write_text(text)
            print(f"wrote {out / name}")
        return 0
    try:
        cfg = load_config(a.config)
        root = a.dir or (cfg.policies.dir if cfg.policies else None)
        if root is None:
            print(f"{a.config}: no policies.dir and no --dir", file=sys.stderr)
            return 2
        ps = load_policies(root, cfg, None if a.dir or cfg.policies is None else cfg.policies.tenants_dir)
    except ConfigError as e:
        print(f"invalid:\n{e}", file=sys.stderr)
        return 1
    print(f"ok: {len(ps.tenants)} tenants ({', '.join(t.name for t in ps.tenants)}), fingerprint {ps.fingerprint[:12]}")
    return 0
