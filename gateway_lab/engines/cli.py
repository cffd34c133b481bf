"""`gateway engines`: build the tiny model, install real engines, start real servers, check the kit.

    gateway engines build-model [--out DIR]
    gateway engines install sglang==0.5.23 [vllm==0.32.0 ...] [--force]
    gateway engines start --engine sglang -n 2 [--state FILE]     (until Ctrl-C)
    gateway engines check [--engine sglang]                         (the kit's self-check, no gateway)
    gateway engines status
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway_lab.engines import envs, model, recipes
from gateway_lab.engines.check import Report, check_server
from gateway_lab.engines.servers import StartError, running, write_state


def register(sub: Any) -> None:
    p = sub.add_parser("engines", help="real SGLang/vLLM on the CPU: model, installs, servers (docs/engines.md)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_subparsers(dest="engines_cmd", required=True)
    b = s.add_parser("build-model", help="the tiny Llama-style model and ChatML tokenizer, built locally")
    b.add_argument("--out", type=Path, default=None, help="default: $GATEWAY_ENGINES_HOME/models/tiny")
    i = s.add_parser("install", help="install engines into cached environments keyed by version")
    i.add_argument("specs", nargs="+", help=f"e.g. {', '.join(f'{e}=={v}' for e, v in sorted(recipes.RECIPES))}")
    i.add_argument("--force", action="store_true", help="reinstall even if the environment is ready")
    st = s.add_parser("start", help="start N real servers on free ports and wait until they serve")
    st.add_argument("--engine", default="sglang", help="sglang or vllm, optionally ==VERSION")
    st.add_argument("-n", type=int, default=2)
    st.add_argument("--state", type=Path, default=None, help="write the servers' URLs and ports as JSON here")
    st.add_argument("--no-cache-report", action="store_true")
    st.add_argument("--no-priority", action="store_true")
    st.add_argument("--dp-size", type=int, default=1, help="SGLang data-parallel ranks per server (one core each)")
    ck = s.add_parser("check", help="the kit's self-check against one real server (no gateway involved)")
    ck.add_argument("--engine", default="sglang")
    s.add_parser("status", help="installed environments and the model")
    d = s.add_parser("diff", help="the simulator against one real SGLang server with the same flags (a report)")
    d.add_argument("--engine", default="sglang")
    d.add_argument("--out", type=Path, default=None, help="write the Markdown report here (else stdout)")
    a = s.add_parser("affinity", help="multi-turn sessions: gateway (approximate, precise) vs round-robin, measured "
                     "by the engines' cached-token counters")
    a.add_argument("--engine", default="sglang")
    a.add_argument("-n", type=int, default=2, help="servers")
    a.add_argument("--sessions", type=int, default=8)
    a.add_argument("--turns", type=int, default=6)
    a.add_argument("--out", type=Path, default=None)
    a.add_argument("--dp-size", type=int, default=1, help="SGLang data-parallel ranks per server (one core each)")


def model_dir() -> Path:
    return envs.home() / "models" / "tiny"


def ensure_model(out: Path | None = None) -> Path:
    out = out or model_dir()
    if not (out / "FINGERPRINT").is_file():
        model.build(out)
    return out


def ready_env(spec: str) -> envs.EngineEnv:
    env = envs.env_for(recipes.recipe(spec))
    if not env.ready:
        raise SystemExit(f"{spec} is not installed: run `gateway engines install {spec}` (docs/engines.md)")
    return env


def run(args: argparse.Namespace) -> int:
    cmd = args.engines_cmd
    if cmd == "build-model":
        t0 = time.monotonic()
        out = args.out or model_dir()
        fp = model.build(out)
        print(f"model and tokenizer in {out} (fingerprint {fp}, {time.monotonic() - t0:.1f} s)")
        return 0
    if cmd == "install":
        for spec in args.specs:
            try:
                env = envs.install(recipes.recipe(spec), force=args.force)
            except (ValueError, envs.InstallError) as e:
                print(f"gateway engines install: {e}", file=sys.stderr)
                return 1
            print(json.dumps({"path": str(env.path), **env.info()}))
        return 0
    if cmd == "status":
        for engine, version in sorted(recipes.RECIPES):
            env = envs.env_for(recipes.recipe(f"{engine}=={version}"))
            state = "ready " + json.dumps(env.info()) if env.ready else "not installed"
            print(f"{engine}=={version}: {state} ({env.path})")
        fpath = model_dir() / "FINGERPRINT"
        print(f"model: {fpath.read_text().strip() if fpath.is_file() else 'not built'} ({model_dir()})")
        return 0
    env = ready_env(args.engine)
    mdir = ensure_model()
    logs = Path(tempfile.mkdtemp(prefix=f"engines-{env.recipe.engine}-"))
    if cmd == "diff":
        from gateway_lab.engines.differential import run_diff

        text = run_diff(env, mdir, logs)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    if cmd == "affinity":
        from gateway_lab.engines.affinity import run_affinity

        text = run_affinity(env, mdir, logs, args.n, args.sessions, args.turns, dp_size=args.dp_size)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    if cmd == "check":
        report = Report(env.recipe.engine)
        try:
            with running(env, str(mdir), 1, logs) as fleet:
                report.steps.append(_started(fleet.servers[0].ready_s))
                check_server(fleet.servers[0], mdir, report)
        except StartError as e:
            print(f"FAIL start: {e}\n{env.recipe.engine}: kit BROKEN at 'start'")
            return 1
        print(report.render())
        return 0 if report.ok else 1
    flags: dict[str, object] = {}
    if args.no_cache_report:
        flags["cache_report"] = False
    if args.no_priority:
        flags["priority"] = False
    if args.dp_size > 1:
        flags["dp_size"] = args.dp_size
    try:
        with running(env, str(mdir), args.n, logs, flags=flags) as fleet:
            for s in fleet.servers:
                print(json.dumps(s.describe()), flush=True)
            if args.state:
                write_state(fleet, args.state)
            print(f"{args.n} {env.recipe.engine} servers serving; Ctrl-C ends them", flush=True)
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
            try:
                while all(s.proc.poll() is None for s in fleet.servers):
                    time.sleep(1)
            except KeyboardInterrupt:
                return 0
            print("a server exited", file=sys.stderr)
            return 1
    except StartError as e:
        print(f"gateway engines start: {e}", file=sys.stderr)
        return 1


def _started(ready_s: float | None) -> Any:
    from gateway_lab.engines.check import Step

    return Step("start", True, f"serving after {ready_s} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gateway engines")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
