"""The `gateway` command: serve, demo, sim, check, admin, policies, replay."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible inference gateway")
    sub = parser.add_subparsers(dest="cmd", required=True)

    from gateway import admin_cli
    from gateway import serve as serve_mod
    from gateway.sim import cli as sim_cli
    from gateway.tenancy import schema_cli

    p_serve = sub.add_parser("serve", help="run the gateway from a config file")
    p_serve.add_argument("--config", required=True)
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8080)
    p_serve.add_argument("--drain-timeout", type=float, default=120.0, help="seconds in-flight requests get after SIGTERM")
    p_serve.add_argument("--drain-delay", type=float, default=None, help="seconds /readyz answers 503 after SIGTERM "
                         "before the listener closes (default: the config's shutdown.readiness_drain_s, 5)")
    p_serve.set_defaults(func=serve_mod.serve)

    p_demo = sub.add_parser("demo", help="a simulated MI355X pool behind the gateway, in-memory state")
    p_demo.add_argument("--host", default="127.0.0.1")
    p_demo.add_argument("--port", type=int, default=8080)
    p_demo.add_argument("--api-key", default="sk-demo")
    p_demo.add_argument("--replicas", type=int, default=2)
    p_demo.add_argument("--sim-port", type=int, default=0,
                        help="first replica port (replicas use SIM_PORT..SIM_PORT+N-1); 0: free ports the OS picks")
    p_demo.add_argument("--time-scale", type=float, default=1.0)
    p_demo.set_defaults(func=serve_mod.demo)

    p_sim = sub.add_parser("sim", help="run simulated SGLang replicas")
    sim_cli.add_arguments(p_sim)
    p_sim.set_defaults(func=sim_cli.run)

    p_admin = sub.add_parser("admin", help="on-call commands over the admin API")
    admin_cli.add_arguments(p_admin)
    p_admin.set_defaults(func=admin_cli.run)

    from gateway import preflight

    p_check = sub.add_parser("check", help="preflight every SGLang server of a config; exits 1 on a misconfiguration")
    p_check.add_argument("--config", required=True)
    p_check.set_defaults(func=preflight.run_check)

    p_pol = sub.add_parser("policies", help="tenant policy tools: check a directory, print the JSON Schema")
    schema_cli.add_arguments(p_pol)
    p_pol.set_defaults(func=schema_cli.run)

    from gateway.replay import cli as replay_cli

    p_replay = sub.add_parser("replay", help="replay a trace through this router on the virtual clock (or over --http)",
                              description=replay_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay_cli.add_arguments(p_replay)
    p_replay.set_defaults(func=replay_cli.run)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
