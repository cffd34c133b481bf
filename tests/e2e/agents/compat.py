"""The agent CLIs' compatibility table, produced by running the agent tier (tests/e2e/agents) against the gateway:
one row per CLI version and check, with what the gateway saw (requests, cached tokens per turn, replicas) and the
CLI's wall time.

    python -m tests.e2e.agents.compat                      # the pinned versions (tests/e2e/agents/pins.json)
    python -m tests.e2e.agents.compat --newest             # each CLI's newest release: reports drift, never fails
    python -m tests.e2e.agents.compat --out docs/results/YYYY-MM-DD-agent-clis.md

`make agent-compat` and `make agent-drift` run these. Exit status: the tier's, except with --newest (always 0: a
new release that breaks is news for the table, not a red build)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.e2e.agents.clis import NpmMissing, newest, pins

ROOT = Path(__file__).resolve().parents[3]


def _versions(use_newest: bool) -> dict[str, list[str]]:
    return {p: [newest(p)] for p in pins()} if use_newest else pins()


def _outcomes(junit: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        state = "pass"
        for tag, word in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                state = word
        out[name] = state
    return out


def run(use_newest: bool) -> tuple[int, str]:
    versions = _versions(use_newest)
    spec = ";".join(f"{p.rsplit('/', 1)[-1]}={','.join(vs)}" for p, vs in versions.items())
    with tempfile.TemporaryDirectory() as tmp:
        records, junit = Path(tmp) / "records.jsonl", Path(tmp) / "junit.xml"
        env = {**os.environ, "GATEWAY_AGENT_VERSIONS": spec, "GATEWAY_AGENT_COMPAT_OUT": str(records),
               "PYTHONPATH": str(ROOT)}
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/agents",
                             f"--junitxml={junit}"], cwd=ROOT, env=env).returncode
        rows = [json.loads(ln) for ln in records.read_text().splitlines()] if records.exists() else []
        outcomes = _outcomes(junit) if junit.exists() else {}
    return rc, table(versions, rows, outcomes, use_newest)


def table(versions: dict[str, list[str]], rows: list[dict], outcomes: dict[str, str], use_newest: bool) -> str:
    today = datetime.date.today().isoformat()
    lines = [f"# Agent CLIs through the gateway, {today}", "",
             f"`python -m tests.e2e.agents.compat{' --newest' if use_newest else ''}` (the tier in tests/e2e/agents: each CLI "
             "as shipped from npm, read-only tools, against a gateway in front of two simulated replicas at 50x).",
             "", "| CLI | check | result | requests seen | cached tokens (first request of each turn / each request) "
             "| replicas | CLI seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['client']} | {r['check']} | {'pass' if r.get('ok') else 'FAIL'} | {r.get('requests', '')} "
                     f"| {r.get('cached_tokens', '')} | {r.get('replicas', '')} | {r.get('seconds', '')} |")
    failed = {k: v for k, v in outcomes.items() if v != "pass"}
    for name, state in sorted(failed.items()):
        lines.append(f"| {name} | (test) | {state} | | | | |")
    lines += ["", "Versions: " + ", ".join(f"{p} {', '.join(vs)}" for p, vs in versions.items()) + "."]
    if use_newest:
        drift = {p: [v for v in vs if v not in pins()[p]] for p, vs in versions.items()}
        lines.append("Newer than the pins: " + (", ".join(f"{p} {v[0]}" for p, v in drift.items() if v) or "none") + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.agents.compat")
    ap.add_argument("--newest", action="store_true", help="each CLI's newest npm release instead of the pins")
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args(argv)
    try:
        rc, text = run(a.newest)
    except NpmMissing as e:
        print(f"skipped: {e}")
        return 0
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0 if a.newest else rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

