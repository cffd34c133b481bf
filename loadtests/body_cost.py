"""CPU to take in one Wafer-sized request body: parse the JSON, validate and count it, prefix-hash it — the per-request
work the gateway does before routing (what docs/deploy.md's sizing adds per request).

    .venv/bin/python -m loadtests.body_cost [--iterations 300]

Then the same steps one at a time, for the Wafer chat body and for the conversation trace's kind of request
(fleet_trace.py: a plain-text completions prompt of `--prompt-tokens` built from the replay's blocks), each the
process CPU of `--iterations` calls (best of three passes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway.pipeline.validation import parse_json, validate
from gateway.prefix.hashing import prefix_hashes
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway_lab.replay.http import prompt_for
from loadtests.report import table
from loadtests.workload import WaferWorkload


def per_call(fn: Callable[[], Any], n: int) -> float:
    """Process CPU seconds per call of `fn`, the best of three passes of `n` calls."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n)
    return best


def steps(raw: bytes, endpoint: str) -> dict[str, Callable[[], Any]]:
    """The body's steps, each as a call."""
    body = parse_json(raw)
    return {"orjson.loads": lambda: orjson.loads(raw), "parse_json": lambda: parse_json(raw),
            "validate + count": lambda: validate(body, endpoint),
            "prefix_hashes": lambda: prefix_hashes(endpoint, body, "glm-5.2", "tenant", 256)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=13000)
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
    prompt = prompt_for(TraceRecord(0.0, a.prompt_tokens, 200, tuple(range(1, a.prompt_tokens // BLOCK_TOKENS + 2))))
    trace = orjson.dumps({"model": "glm-5.2", "prompt": prompt, "max_tokens": 200, "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True})
    rows = []
    for name, raw, endpoint in (("Wafer chat", raws[0], "chat/completions"),
                                (f"trace completions, {a.prompt_tokens} tokens", trace, "completions")):
        rows.append([name, f"{len(raw) / 1024:.0f}",
                     *(f"{per_call(f, a.iterations) * 1e6:.1f}" for f in steps(raw, endpoint).values())])
    print(table(["body", "KiB", *(f"{s} us" for s in steps(trace, "completions"))], rows))


if __name__ == "__main__":
    main()
