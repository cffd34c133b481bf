"""The `gateway` command: serve, check, admin, policies, config — and the commands other installed packages add.

Only the command being run is imported: `gateway admin ...` loads the admin CLI alone (httpx and the standard
library), never the server, so an on-call's command starts in a fraction of a second (tests/test_admin_cli.py
checks what it imports). Each built-in command is a module with `add_arguments(parser)` and `run(args)`.

The runtime never imports its lab (the simulator, replay, the demo): `gateway_lab` adds `sim`, `replay` and `demo`
through the `gateway.commands` entry-point group (pyproject.toml), each a `register(subparsers)` function. A
deployment that does not install the lab gets the runtime's commands only."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# name -> (module with add_arguments/run, help)
BUILTIN = {
    "serve": ("gateway.serve", "run the gateway from a config file"),
    "admin": ("gateway.admin_cli", "on-call commands over the admin API (tables; -o json)"),
    "check": ("gateway.check", "preflight a config's replicas and hosted pools; exits 1 on a misconfiguration"),
    "policies": ("gateway.tenancy.schema_cli", "tenant policy tools: check a directory, print the JSON Schema"),
    "config": ("gateway.settings.reference", "config tools: write the config reference (docs/config-reference.md)"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible inference gateway")
    sub = parser.add_subparsers(dest="cmd", required=True)
    chosen = next((a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")), None)
    for name, (module, help_) in BUILTIN.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    if chosen in BUILTIN:
        return parser  # the lab's commands are not looked up (scanning installed packages costs time)
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group="gateway.commands"), key=lambda e: e.name):
        if ep.name == chosen:
            ep.load()(sub)  # only the command being run is imported: `gateway serve` loads no lab code
        else:
            sub.add_parser(ep.name, help=f"({ep.value.split(':')[0]}; `gateway {ep.name} -h` for its options)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args: Any = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
