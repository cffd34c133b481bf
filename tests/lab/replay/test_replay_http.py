"""`gateway replay --http`: the trace's prompts rebuilt from deterministic blocks, sent open-loop over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

TIME_SCALE = 20.0


def test_replay_over_http_against_the_gateway(tmp_path: Path) -> None:
    """`gateway replay --http` sends the trace open-loop through the real gateway: every request answered, and
    turns that share blocks with earlier ones come back with cache hits."""
    from gateway.cli import main
    from gateway.recording.trace import write_trace
    from loadtests.agent_workload import Params, generate

    trace = generate(Params(sessions=6, rate=2.0, turns_mean=3, system_median=2_000, tool_median=500, seed=3))[:20]
    p, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    with p.open("w") as f:
        write_trace(trace, f)
    sims, _ = start_sims(2, time_scale=TIME_SCALE)
    gw = start_gateway(config([sglang_pool("p", sims.urls)]))
    try:
        rc = main(["replay", str(p), "--http", gw.urls[0] + "/v1", "--api-key", KEY_A, "--http-model", "glm-5.2",
                   "--speed", "20", "--json", str(out)])
    finally:
        gw.stop()
        sims.stop()
    s = json.loads(out.read_text())["summary"]
    assert rc == 0 and s["ok"] == s["requests"] == len(trace) > 10
    assert s["hit_rate"] > 0.2
