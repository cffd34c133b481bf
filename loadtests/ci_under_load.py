"""`.ci/run` on fresh clones while a busy loop holds each core: does the suite stay green on a machine whose cores are
busy with other work? Each run clones this checkout's HEAD into a temporary directory, starts one
`python3 -c "while True: pass"` per core, runs `.ci/run` (the engine tier left out unless `--engine-tests`), stops the
loops by PID and prints one row. Runs go one after another and stop at the first failure; the failing run's output
is kept (its path is printed).

    python -m loadtests.ci_under_load --runs 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summary(log: Path) -> str:
    """pytest's last summary line ("N passed, ... in S s"), or the last line of the output."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    found = [ln for ln in lines if " passed" in ln or " failed" in ln]
    return (found or lines or ["(no output)"])[-1]


def one_run(n: int, engine_tests: bool, busy: int) -> tuple[int, float, str, Path]:
    work = Path(tempfile.mkdtemp(prefix=f"gw-ci-load-{n}-"))
    clone = work / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "GATEWAY_ENGINE_TESTS": "1" if engine_tests else "0"}
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    log = work / "ci.log"
    start = time.monotonic()
    try:
        with log.open("wb") as out:
            rc = subprocess.run([str(clone / ".ci" / "run")], cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT).returncode
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return rc, time.monotonic() - start, summary(log), work


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs in a row (stops at the first failure)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops beside each run (default: one "
                   "per core)")
    p.add_argument("--engine-tests", action="store_true", help="keep the engine tier in (it needs its environments)")
    a = p.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    print(f"commit {head}, {a.busy} busy loop(s), engine tier {'in' if a.engine_tests else 'out'}")
    print("| run | exit | wall | suite |\n|---|---|---|---|")
    for n in range(1, a.runs + 1):
        rc, wall, line, work = one_run(n, a.engine_tests, a.busy)
        print(f"| {n} | {rc} | {int(wall) // 60} min {int(wall) % 60:02d} s | {line} |", flush=True)
        if rc != 0:
            print(f"run {n} failed; its clone and output: {work}")
            return rc
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
