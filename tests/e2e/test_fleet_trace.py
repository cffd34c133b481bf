"""`python -m loadtests.fleet_trace` end to end on a tiny trace, this gateway only (no peers): simulator processes,
a private Redis, the gateway, the replay client; the table, the JSON and the PNG. The full run against the peers is
in docs/results/2026-11-27-loadtests.md ("Fleet over HTTP on a slice of the conversation trace")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.recording.trace import TraceRecord, write_trace
from tests.support import free_port, free_port_base


def _sessions() -> list[TraceRecord]:
    """3 sessions x 4 turns; each turn's prompt is the last one plus two blocks, so later turns share a prefix."""
    out = []
    for s in range(3):
        ids: list[int] = [1000 + s]  # every session its own first block: the shared part is per session
        for t in range(4):
            ids += [10_000 * (s + 1) + 2 * t, 10_000 * (s + 1) + 2 * t + 1]
            out.append(TraceRecord(timestamp_ms=(t * 3 + s) * 1000.0, input_length=512 * len(ids) - 100,
                                   output_length=8, hash_ids=tuple(ids)))
    return sorted(out, key=lambda r: r.timestamp_ms)


def test_fleet_trace_replays_a_slice_through_the_gateway(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        write_trace(_sessions(), f)
    for _ in range(3):
        # the script takes port..port+3 for gateways and sim_port.. for the simulators: whole free ranges, not one
        # port; another test can still take one before the script binds it (the gateway exits "already in use" and
        # the script reports the target as not started, its result missing): the run is made again on other ports,
        # and a target that never starts still fails below
        port, sim_port, redis_port = free_port_base((0, 1, 2, 3)), free_port_base((0, 1, 2, 3)), free_port()
        r = subprocess.run([sys.executable, "-m", "loadtests.fleet_trace", "--trace", str(trace), "--slice-s", "60",
                            "--nodes", "1", "--time-scale", "20", "--targets", "this router", "--out",
                            str(tmp_path / "r"), "--png", str(tmp_path / "r.png"), "--port", str(port), "--sim-port",
                            str(sim_port), "--redis-port", str(redis_port), "--idle-s", "1"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or "this router" in json.loads((tmp_path / "r.json").read_text())["results"]:
            break
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert "this router" in res["results"], r.stderr[-2000:]
    s = res["results"]["this router"]
    assert s["requests"] == s["ok"] == 12 and s["failed"] == 0
    assert s["engine_hit"] > 0.3  # later turns found their session's earlier blocks on the replica it went to
    assert res["bounds"]["ideal"] > s["engine_hit"] * 0.9
    assert "this router |" in r.stdout and (tmp_path / "r.png").stat().st_size > 10_000
    # the router's own background, measured and printed (over 1 s it may be below procfs' 10 ms tick: 0 is a reading)
    assert s["idle_cpu_ms_per_s"] >= 0 and "idle CPU ms/s" in r.stdout

