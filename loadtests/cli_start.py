"""How long an on-call waits for `gateway admin ...`: wall time of whole CLI runs (a fresh interpreter each, as a
shell runs it) against a running `gateway demo`'s admin listener, next to what importing the server costs (what
every CLI call paid when `gateway` imported the server for any command).

    .venv/bin/python -m loadtests.cli_start --runs 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from loadtests.procs import Proc
from tests.support import free_port


def timed(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        out.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.returncode}: {r.stderr}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    a = p.parse_args()
    port, admin = free_port(), free_port()
    demo = Proc("demo", [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--admin-port", str(admin),
                         "--time-scale", "20"], f"http://127.0.0.1:{admin}/healthz")
    try:
        demo.wait_ready(60)
        url = f"http://127.0.0.1:{admin}"
        base = [sys.executable, "-m", "gateway.cli", "admin", "--url", url, "--token", "admin-demo"]
        rows = [("gateway admin state", timed(base + ["state"], a.runs)),
                ("gateway admin state -o json", timed(base + ["state", "-o", "json"], a.runs)),
                ("gateway admin audit", timed(base + ["audit"], a.runs)),
                ("python -c 'import gateway.app' (the server's imports)",
                 timed([sys.executable, "-c", "import gateway.app"], a.runs))]
    finally:
        demo.stop()
    print("| command | runs | median s | max s |\n|---|---|---|---|")
    for name, ts in rows:
        print(f"| `{name}` | {len(ts)} | {statistics.median(ts):.2f} | {max(ts):.2f} |")


if __name__ == "__main__":
    main()
