"""`gateway replay --pd P:D`: the PD fleet on the virtual clock serves every request of a trace slice (none lost,
none left holding KV or load), the fixed run disaggregates everything, the auto run labels every request with a
branch of the decision, and the CLI prints the three runs side by side."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from gateway.config import Routing
from gateway.recording.trace import read_trace
from gateway_lab.replay.pd import compare, run_pd, trace_arrivals, wafer_arrivals
from gateway_lab.sim.pd import DecodeRank, PrefillRank
from tests.support import env_without_proxies


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> str:
    """A Mooncake-format trace: 150 conversations' turns at ~3 req/s, 1k-24k-token prompts sharing system prompts
    and earlier turns (equal leading block ids), as the conversation trace does."""
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    convs: list[list[int]] = []
    next_block = 1000
    with open(path, "w") as f:
        for i in range(150):
            if convs and rng.random() < 0.5:
                blocks = rng.choice(convs)
            else:
                blocks = [rng.randrange(4)]  # one of 4 system prompts
                convs.append(blocks)
            grow = rng.randrange(2, 40)
            blocks.extend(range(next_block, next_block + grow))
            next_block += grow
            n = len(blocks)
            f.write(json.dumps({"timestamp": i * 330, "input_length": n * 512 - rng.randrange(511),
                                "output_length": rng.randrange(20, 400), "hash_ids": list(blocks)}) + "\n")
    return str(path)


def test_pd_fleet_serves_every_request_and_releases_everything(trace_file):
    trace = read_trace(trace_file, 150)
    for mode, branches in (("always", {"pd_fixed"}), ("auto", None)):
        done, gaps = run_pd(trace_arrivals(trace, Routing()), 2, 2, mode, Routing())
        assert len(done) == 150 and all(d.ttft is not None and d.end is not None for d in done)
        if branches:
            assert {d.branch for d in done} == branches
        else:
            assert {d.branch for d in done} <= {"unified_short", "unified_no_prefill", "pd_sla", "unified_sla",
                                                 "pd_cheaper", "unified_cheaper", "pd_faster", "unified_faster"}
        assert sum(n for _, n in gaps) > 0


def test_pd_fleet_ranks_end_idle(trace_file):
    from gateway.pd_config import Disaggregation
    from gateway_lab.replay.pd import PdFleet, _jobs

    trace = read_trace(trace_file, 80)
    d = Disaggregation.model_validate({"prefill": [{"name": "p0", "url": "http://sim"}], "decide": "always"})
    fleet = PdFleet(1, 1, d, Routing())
    fleet.feed(_jobs(trace, Routing(), 64, 1.0))
    fleet.run()
    p, dec = fleet.prefill[0].rank, fleet.decode[0].rank
    assert isinstance(p, PrefillRank) and isinstance(dec, DecodeRank)
    assert not p.sending and not dec.prealloc and not dec.transferring and not dec.running
    assert p.reserved == dec.reserved == 0 and p.cache.locked_tokens == 0
    assert fleet.p_queued == [0.0] and fleet.d_inflight == [0]
    assert fleet.fabric.transfers == 80 and not fleet.fabric.rooms


def test_compare_has_the_three_runs(trace_file):
    trace = read_trace(trace_file, 120)
    rows = compare(trace_arrivals(trace, Routing()), trace[-1].timestamp_ms / 1000, 1, 1, Routing())
    assert [r.label for r in rows] == ["unified x2", "pd fixed 1:1", "pd auto 1:1"]
    assert all(r.requests == 120 for r in rows)
    assert rows[1].branches == {"pd_fixed": 120}


def test_cli_prints_the_table(trace_file):
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "replay", trace_file, "--pd", "1:1", "--limit", "60",
                          "--no-progress"], capture_output=True, text=True, timeout=300, env=env_without_proxies())
    assert out.returncode == 0, out.stderr
    assert "pd fixed 1:1" in out.stdout and "pd auto 1:1" in out.stdout and "unified x2" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "replay", trace_file, "--pd", "0:2"], capture_output=True,
                         text=True, timeout=60, env=env_without_proxies())
    assert bad.returncode == 2 and "--pd expects P:D" in bad.stderr


def test_the_wafer_workload_runs_through_all_three():
    """20k-token prompts sharing 12k-token group prefixes: the PD runs hit the group prefixes on the prefill ranks."""
    rows = compare(wafer_arrivals(2, 0.8, 40.0, Routing()), 40.0, 1, 1, Routing())
    assert [r.requests for r in rows] == [rows[0].requests] * 3 and rows[0].requests > 20
    assert rows[1].hit_rate > 0.2  # the 12k group prefixes (60% of each prompt) are found again after first use
