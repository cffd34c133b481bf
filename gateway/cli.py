"""The `gateway` command: serve, check, admin, policies, config — and the commands other installed packages add.

The runtime never imports its lab (the simulator, replay, the demo): `gateway_lab` adds `sim`, `replay` and `demo`
through the `gateway.commands` entry-point group (pyproject.toml), each a `register(subparsers)` function. A
deployment that does not install the lab gets the runtime's commands only."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible inference gateway")
    sub = parser.add_subparsers(dest="cmd", required=True)

    from gateway import admin_cli
    from gateway import serve as serve_mod
    from gateway.tenancy import schema_cli

    p_serve = sub.add_parser("serve", help="run the gateway from a config file")
    p_serve.add_argument("--config", required=True)
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8080)
    p_serve.add_argument("--drain-timeout", type=float, default=120.0, help="seconds in-flight requests get after SIGTERM")
    p_serve.add_argument("--drain-delay", type=float, default=None, help="seconds /readyz answers 503 after SIGTERM "
                         "before the listener closes (default: the config's shutdown.readiness_drain_s, 5)")
    p_serve.set_defaults(func=serve_mod.serve)

    p_admin = sub.add_parser("admin", help="on-call commands over the admin API")
    admin_cli.add_arguments(p_admin)
    p_admin.set_defaults(func=admin_cli.run)

    from gateway import preflight

    p_check = sub.add_parser("check", help="preflight every SGLang server of a config; exits 1 on a misconfiguration")
    p_check.add_argument("--config", required=True)
    p_check.set_defaults(func=preflight.run_check)

    from gateway.settings import reference

    p_cfg = sub.add_parser("config", help="config tools: write the config reference (docs/config-reference.md)")
    reference.add_arguments(p_cfg)
    p_cfg.set_defaults(func=reference.run)

    p_pol = sub.add_parser("policies", help="tenant policy tools: check a directory, print the JSON Schema")
    schema_cli.add_arguments(p_pol)
    p_pol.set_defaults(func=schema_cli.run)

    chosen = next((a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")), None)
    for ep in sorted(entry_points(group="gateway.commands"), key=lambda e: e.name):
        if ep.name == chosen:
            ep.load()(sub)  # only the command being run is imported: `gateway serve` loads no lab code
        else:
            sub.add_parser(ep.name, help=f"({ep.value.split(':')[0]}; `gateway {ep.name} -h` for its options)")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
