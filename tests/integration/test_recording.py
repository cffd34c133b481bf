"""Recording live traffic: a gateway session over real HTTP (the openai SDK, simulated SGLang replicas) is recorded
as an anonymized trace, and replaying that trace through `gateway replay` on the virtual clock against the same
fleet reproduces the recorded cache-hit rate — the tool a user would trust to try a changed fleet or policy."""

from __future__ import annotations

import json
import random
from pathlib import Path

from openai import OpenAI

from gateway.config import parse_config
from gateway.replay.run import replay, targets_from_config
from gateway.replay.trace import read_trace
from tests.helpers import start_sims, wait_until
from tests.integration.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway

TIME_SCALE = 20.0  # the simulators run 20x faster than real time; the replay stretches the arrivals back


def words(rng: random.Random, n_tokens: int) -> str:
    return " ".join(f"w{rng.randrange(10**6):06d}" for _ in range(n_tokens * 4 // 8))  # 8 chars ~ 2 tokens


def test_recorded_session_replays_to_the_same_hit_rate(tmp_path: Path) -> None:
    sims, _ = start_sims(2, time_scale=TIME_SCALE)
    out = tmp_path / "recorded.jsonl"
    cfg = config([sglang_pool("p", sims.urls)], recording={"path": str(out), "max_requests": 1000})
    gw = start_gateway(cfg)
    rng = random.Random(7)
    systems = [words(rng, 16_000) for _ in range(2)]
    sessions = [[{"role": "system", "content": systems[s % 2]}] for s in range(6)]
    seen_prompt = seen_cached = 0
    try:
        client = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        for _turn in range(4):  # multi-turn agents: each turn is the last prompt + the answer + a tool output
            for msgs in sessions:
                msgs.append({"role": "user", "content": words(rng, 1_500)})
                r = client.chat.completions.create(model="glm-5.2", messages=msgs, max_tokens=16,
                                                   extra_body={"ignore_eos": True})
                msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
                seen_prompt += r.usage.prompt_tokens
                seen_cached += r.usage.prompt_tokens_details.cached_tokens
        # accounting (and so the record) runs just after each response: wait for the last one
        wait_until(lambda: out.exists() and len(out.read_text().splitlines()) == 24, 10, "24 recorded requests")
    finally:
        gw.stop()
        sims.stop()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 24
    text = out.read_text()
    assert "w0" not in text and "tenant-a" not in text  # no prompt text, no tenant name
    trace = read_trace(out)
    recorded_hit = sum(r.cached_tokens or 0 for r in trace) / sum(r.input_length for r in trace)
    assert recorded_hit == seen_cached / seen_prompt > 0.5
    gc = parse_config(cfg)
    replayed = replay(trace, targets_from_config(gc), gc.routing, speed=1 / TIME_SCALE)
    assert replayed.requests == 24
    assert abs(replayed.hit_rate - recorded_hit) <= 0.02, (replayed.hit_rate, recorded_hit)

