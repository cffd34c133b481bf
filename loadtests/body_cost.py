"""CPU to take in one Wafer-sized request body: parse the JSON, validate and count it, prefix-hash it — the per-request
work the gateway does before routing (what docs/deploy.md's sizing adds per request).

    .venv/bin/python -m loadtests.body_cost [--iterations 300]
"""

from __future__ import annotations

import argparse
import time

import orjson

from gateway.pipeline.validation import parse_json, validate
from gateway.prefix.hashing import prefix_hashes
from loadtests.workload import WaferWorkload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=300)
    a = p.parse_args()
    wl = WaferWorkload(groups=16, seed=1)
    raws = [orjson.dumps(wl.body(i % 16)) for i in range(a.iterations)]
    start = time.process_time()
    for raw in raws:
        parsed = validate(parse_json(raw), "chat/completions")
        prefix_hashes("chat/completions", parsed.body, "glm-5.2", "tenant", 256)
    per = (time.process_time() - start) / a.iterations
    print(f"Wafer body: {len(raws[0]) / 1024:.0f} KiB, {parsed.prompt_tokens} prompt tokens (gateway count); "
          f"parse + validate + count + prefix-hash: {per * 1000:.2f} ms CPU per request ({a.iterations} iterations)")


if __name__ == "__main__":
    main()
