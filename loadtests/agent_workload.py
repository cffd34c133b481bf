"""Multi-turn agent sessions as a trace in the replay format (Mooncake JSONL, 512-token hash_ids), for
`gateway replay` (virtual clock or `--http`).

    .venv/bin/python -m loadtests.agent_workload --sessions 600 --rate 0.5 --out loadtests/out/agent_trace.jsonl

What it models (each knob a flag):
- sessions start as a Poisson process, and in bursts (`--burst-p`: a start brings `--burst-size` more within a second);
- each session opens with a system prompt (tools included) drawn Zipf-popular (`--systems`, `--zipf`) from a set of
  lognormal lengths, then a user message;
- each turn's prompt is the last prompt + the answer + a tool output (lognormal, long-tailed) + a short user/assistant
  glue, so contexts grow turn after turn until `--max-context` or the session's turn count (geometric);
- the next turn arrives after the answer's estimated generation time plus a think/tool time (exponential).
Block ids: a full block keeps its id for the rest of the session (equal ids = equal prefix); full blocks inside a
shared system prompt carry that prompt's ids, so sessions on the same system prompt share them; a trailing partial
block is always new.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gateway.recording.trace import BLOCK_TOKENS, TraceRecord, write_trace
from gateway_lab.replay.bounds import ideal_hit_rate


@dataclass
class Params:
    sessions: int = 600
    rate: float = 0.5  # session starts per second
    systems: int = 40
    zipf: float = 1.1
    system_median: int = 3_000
    user_median: int = 400
    tool_median: int = 1_500
    output_median: int = 300
    turns_mean: float = 8.0
    think_mean_s: float = 6.0
    max_context: int = 128_000
    burst_p: float = 0.05
    burst_size: int = 8
    seed: int = 0


def _lognormal(rng: random.Random, median: int, sigma: float = 0.8, lo: int = 16, hi: int = 60_000) -> int:
    return int(min(hi, max(lo, median * math.exp(rng.gauss(0, sigma)))))


@dataclass
class _Session:
    system: int
    start: float
    turns: int
    length: int = 0
    ids: list[int] = field(default_factory=list)  # ids of the full blocks so far


def generate(p: Params) -> list[TraceRecord]:
    rng = random.Random(p.seed)
    fresh = itertools.count()
    sys_len = [_lognormal(rng, p.system_median, 0.7, 256, 30_000) for _ in range(p.systems)]
    sys_ids = [[next(fresh) for _ in range(n // BLOCK_TOKENS)] for n in sys_len]
    weights = [1 / (k + 1) ** p.zipf for k in range(p.systems)]
    starts: list[float] = []
    t = 0.0
    while len(starts) < p.sessions:
        t += rng.expovariate(p.rate)
        starts.append(t)
        if rng.random() < p.burst_p:
            starts.extend(t + rng.random() for _ in range(p.burst_size))
    starts = sorted(starts[: p.sessions])
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    for start in starts:
        s = _Session(rng.choices(range(p.systems), weights)[0], start, 1 + int(rng.expovariate(1 / (p.turns_mean - 1))))

        def append(n: int, s: _Session = s) -> None:
            s.length += n
            while len(s.ids) < s.length // BLOCK_TOKENS:
                k = len(s.ids)
                s.ids.append(sys_ids[s.system][k] if k < len(sys_ids[s.system]) else next(fresh))

        append(sys_len[s.system])
        append(_lognormal(rng, p.user_median))
        at = start
        for _ in range(s.turns):
            if s.length > p.max_context:
                break
            partial = [next(fresh)] if s.length % BLOCK_TOKENS else []
            n_out = _lognormal(rng, p.output_median, 0.6, 8, 4_000)
            out.append((at, s.length, n_out, tuple(s.ids + partial)))
            # the answer, the tool's output and a little glue become the next prompt's tail
            append(n_out)
            append(_lognormal(rng, p.tool_median, 1.1, 32, 40_000))
            append(rng.randint(20, 120))
            at += 1.0 + n_out / 100 + rng.expovariate(1 / p.think_mean_s)
    out.sort(key=lambda r: r[0])
    return [TraceRecord(round(a * 1000, 3), n_in, n_out, ids) for a, n_in, n_out, ids in out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, f in Params.__dataclass_fields__.items():
        default = f.default
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--out", default="loadtests/out/agent_trace.jsonl")
    a = ap.parse_args(argv)
    p = Params(**{k: getattr(a, k) for k in Params.__dataclass_fields__})
    trace = generate(p)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        write_trace(trace, f)
    n_in = sorted(r.input_length for r in trace)
    print(f"wrote {a.out}: {len(trace)} requests over {trace[-1].timestamp_ms / 1000:.0f} s "
          f"({len(trace) / (trace[-1].timestamp_ms / 1000):.2f} req/s), input mean {sum(n_in) / len(n_in):.0f} / median "
          f"{n_in[len(n_in) // 2]} / p99 {n_in[int(len(n_in) * 0.99)]}, ideal hit {ideal_hit_rate(trace) * 100:.1f}%",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
