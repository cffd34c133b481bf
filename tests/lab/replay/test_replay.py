"""`gateway replay`: the trace format, the hit-rate bounds, and the command end to end on the virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.recording.trace import TraceError, TraceRecord, read_trace, write_trace
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate
from loadtests.agent_workload import Params, generate

GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("bad, says", [
    ('{"timestamp": 0, "input_length": 1000', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": -5, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}', "'timestamp'"),
    ('{"timestamp": 9, "output_length": 1, "hash_ids": [1, 2]}', "'input_length'"),
    ('{"timestamp": 9, "input_length": 1000, "output_length": "x", "hash_ids": [1, 2]}', "'output_length'"),
    ('{"timestamp": 9, "input_length": 1000, "output_length": 1, "hash_ids": [1, "a"]}', "'hash_ids'"),
    ('{"timestamp": 9, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2, 3]}', "ceil(1000 / 512) = 2"),
])
def test_trace_errors_name_the_file_and_line(tmp_path: Path, bad: str, says: str) -> None:
    """A broken line anywhere in a 12k-line trace must be findable: the error names path:line and what is wrong."""
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n" + GOOD + bad + "\n" + GOOD)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert f"{p}:4:" in str(e.value) and says in str(e.value)


def test_the_cli_names_the_line_and_prints_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + GOOD.replace('"hash_ids": [1, 2]', '"hash_ids": 7'))
    assert main(["replay", str(p), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "'hash_ids'" in err and "Traceback" not in err


def test_out_of_order_lines_are_read_in_arrival_order(tmp_path: Path) -> None:
    """Recordings are written as requests finish; replay needs them by arrival."""
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD.replace('"timestamp": 0', '"timestamp": 50') + GOOD)
    assert [r.timestamp_ms for r in read_trace(p)] == [0, 50]
    assert [r.timestamp_ms for r in read_trace(p, limit=1)] == [0]


def test_records_round_trip_with_the_recording_fields(tmp_path: Path) -> None:
    recs = [TraceRecord(0.0, 1000, 5, (7, 8)), TraceRecord(12.5, 513, 0, (7, 9), tenant=3, cached_tokens=512)]
    p = tmp_path / "r.jsonl"
    with p.open("w") as f:
        write_trace(recs, f)
    assert read_trace(p) == recs
    assert "tenant" not in p.read_text().splitlines()[0]  # plain Mooncake lines stay plain


def test_ideal_and_lru_bounds_by_hand() -> None:
    """Token-weighted, full blocks only: a shared first block is a hit while it is resident, a partial one never."""
    a = TraceRecord(0, 1024, 1, (1, 2))
    b = TraceRecord(1, 1000, 1, (1, 3))  # block 1 full and seen; block 3 partial
    c = TraceRecord(2, 1024, 1, (4, 5))
    d = TraceRecord(3, 1024, 1, (1, 2))
    trace = [a, b, c, d]
    total = 1024 + 1000 + 1024 + 1024
    assert ideal_hit_rate(trace) == pytest.approx((512 + 1024) / total)
    # room for 2 blocks: c's blocks push out 1 and 2 before d comes back
    assert lru_hit_rate(trace, 2 * 512) == pytest.approx(512 / total)
    assert lru_hit_rate(trace, 100 * 512) == pytest.approx(ideal_hit_rate(trace))


def test_replay_compare_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command runs the trace through each policy on one fleet: this router keeps more of the reachable hits
    than round-robin, never more than the trace allows, and every number lands in the JSON."""
    p = tmp_path / "agent.jsonl"
    with p.open("w") as f:
        write_trace(generate(Params(sessions=60, rate=0.5, seed=1)), f)
    out = tmp_path / "r.json"
    assert main(["replay", str(p), "--nodes", "1", "--compare", "--no-progress", "--json", str(out), "--branches",
                 "--tail"]) == 0
    text = capsys.readouterr().out
    assert "| prefix_sla_cost " in text and "| round_robin " in text and "x2 unshared" in text
    assert "where the hits go" in text and "the TTFT tail" in text and "index corrections" in text
    res = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    mine, rr = res["prefix_sla_cost"], res["round_robin"]
    assert mine["requests"] == rr["requests"] == len(read_trace(p))
    assert rr["hit_rate"] < mine["hit_rate"] <= mine["ideal_hit_rate"] + 1e-9
    assert 0 < mine["ttft_p50"] <= mine["ttft_p95"] <= mine["ttft_p99"] and mine["slowdown_p95"] >= 1
    tl = mine["timeline"]  # predicted vs real cached tokens per minute add up to the run's hit rate
    assert sum(w[4] for w in tl) / sum(w[2] for w in tl) == pytest.approx(mine["hit_rate"])
    assert sum(w[1] for w in tl) == mine["requests"]
    assert rr["corrections"] == 0 <= mine["corrections"]  # round-robin predicts no cached tokens: nothing to correct
    tail = mine["tail"]  # the requests over p95, each either slow alone or slow from waiting, per branch
    assert tail["over"] == tail["alone"] + tail["waited"] == sum(v["alone"] + v["waited"] for v in tail["branches"].values())
    assert 0 < tail["over"] <= 0.05 * mine["requests"] + 1 and tail["observed_over_raw_p50"] > 0


def test_jitter_seeds_replay_each_run_under_noise_and_summarize(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--jitter perturbs every engine forward from a seeded stream: one seed replays the same twice, two seeds differ,
    and the seed table sums the rows up. --seeds without --jitter is refused, naming the flag."""
    p = tmp_path / "agent.jsonl"
    with p.open("w") as f:
        write_trace(generate(Params(sessions=30, rate=0.5, seed=2)), f)
    runs = []
    for name, seeds in (("a", "2"), ("b", "1")):
        out = tmp_path / f"{name}.json"
        assert main(["replay", str(p), "--nodes", "1", "--no-progress", "--jitter", "0.3", "--seeds", seeds,
                     "--json", str(out)]) == 0
        runs.append({r["label"]: r for r in json.loads(out.read_text())["results"]})
    text = capsys.readouterr().out
    assert "prefix_sla_cost seed 2" in text and "Over 2 seed(s) at jitter 0.3" in text
    one, two = runs[0]["prefix_sla_cost seed 1"], runs[0]["prefix_sla_cost seed 2"]
    assert one["ttft_mean"] == runs[1]["prefix_sla_cost seed 1"]["ttft_mean"]  # seeded: reproducible
    assert one["ttft_mean"] != two["ttft_mean"]  # and the noise is real
    assert main(["replay", str(p), "--nodes", "1", "--no-progress", "--seeds", "3"]) == 2
    assert "--seeds needs --jitter" in capsys.readouterr().err


def test_tail_splits_slow_alone_from_slow_waiting() -> None:
    from gateway_lab.replay.run import tail_summary
    from gateway_lab.sim.fleet import Record

    def rec(branch: str, ttft: float, idle: float, pred: float, raw: float) -> Record:
        return Record(0.0, 0, "r", "p", branch, 1000, 10, 0, 0, True, pred, raw, ttft=ttft, idle_ttft=idle)

    done = [rec("a", 0.5, 0.4, 1.0, 0.5)] * 8 + [rec("a", 5.0, 4.0, 10.0, 5.0), rec("b", 4.0, 0.3, 8.0, 4.0)]
    t = tail_summary(done, 1.0)
    assert (t["over"], t["alone"], t["waited"]) == (2, 1, 1)
    assert t["branches"] == {"a": {"alone": 1, "waited": 0}, "b": {"alone": 0, "waited": 1}}
    assert t["observed_over_predicted_p50"] == 0.5 and t["observed_over_raw_p50"] == 1.0 and t["abs_error_raw_s"] == 0


def test_agent_workload_grows_contexts_and_shares_system_prompts() -> None:
    trace = generate(Params(sessions=40, seed=2))
    firsts = {r.hash_ids[0] for r in trace}
    assert len(firsts) < 40  # Zipf-popular system prompts: sessions share leading blocks
    assert ideal_hit_rate(trace) > 0.5  # multi-turn: each turn extends the last
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)


def test_http_prompts_share_text_exactly_where_the_trace_shares_blocks() -> None:
    """Rebuilt prompts: equal leading block ids give equal text on 512-token boundaries, so the gateway's chunk
    hashes (and the engine's pages) agree exactly as far as the trace says and no further."""
    from gateway.prefix.hashing import prefix_hashes
    from gateway_lab.replay.http import prompt_for

    a, b = TraceRecord(0, 1800, 1, (5, 6, 7, 8)), TraceRecord(0, 2000, 1, (5, 6, 9, 10))
    pa, pb = prompt_for(a), prompt_for(b)
    assert (len(pa), len(pb)) == (1800 * 4, 2000 * 4) and pa[:4096] == pb[:4096] and pa[4096:4100] != pb[4096:4100]
    ha = prefix_hashes("completions", {"prompt": pa}, "m", "", 256)
    hb = prefix_hashes("completions", {"prompt": pb}, "m", "", 256)
    assert ha[:4] == hb[:4] and ha[4] != hb[4]


def test_a_stale_index_entry_is_corrected_and_counted() -> None:
    """The index says a replica holds a prompt its engine never saw: the engine's usage report corrects it, and the
    replay counts the correction (the gateway's gateway_prefix_index_corrections_total)."""
    from gateway.config import Routing
    from gateway_lab.replay.run import nodes_targets, replay, to_job
    from gateway_lab.sim.fleet import Fleet

    trace = [TraceRecord(0.0, 4096, 8, tuple(range(8)))]
    targets = nodes_targets(1)
    rc = Routing()
    job = to_job(trace[0], 0, rc.chunk_tokens, targets[0][1].page_size, 2.22)

    def stale(fleet: Fleet) -> None:
        fleet.instances[0].index.insert_sync(targets[0][0].key, job.req.hashes, 1e9)

    fresh = replay(trace, targets, rc, bounds=(0.0, 0.0))
    r = replay(trace, targets, rc, fleet_hook=stale, bounds=(0.0, 0.0))
    assert (fresh.corrections, r.corrections) == (0, 1) and r.hit_rate == 0
