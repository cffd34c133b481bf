"""Recording live traffic: a gateway session over real HTTP (the openai SDK, simulated SGLang replicas) is recorded
as an anonymized trace, and replaying that trace through `gateway replay` on the virtual clock against the same
fleet reproduces the recorded cache-hit rate — the tool a user would trust to try a changed fleet or policy."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
from openai import OpenAI

from gateway.config import hash_key, parse_config
from gateway.recording.trace import read_trace
from gateway_lab.replay.run import replay, targets_from_config
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import env_without_proxies, start_sims, wait_until

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



ADMIN = "admin-recording-token"
ADMIN_H = {"authorization": f"Bearer {ADMIN}", "x-admin-actor": "oncall"}


def test_on_call_starts_and_stops_a_recording_through_the_admin_api(tmp_path: Path) -> None:
    """`recording.autostart: false`: nothing is recorded until on-call starts it; a start truncates (one file, one
    recording); a stop keeps the file as written and records nothing more; the path only comes from the config; every
    switch is in the audit log; bad calls get the API's error shape."""
    sims, _ = start_sims(1, time_scale=TIME_SCALE)
    out = tmp_path / "on-call.jsonl"
    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]},
                 recording={"path": str(out), "autostart": False})
    gw = start_gateway(cfg)
    base = gw.admin_url
    client = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)

    def chat(n: int) -> None:
        for i in range(n):
            client.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": f"turn {i}"}],
                                           max_tokens=2)

    def status() -> dict:
        r = httpx.get(base + "/admin/recording", headers=ADMIN_H)
        assert r.status_code == 200
        return r.json()

    try:
        chat(2)
        assert status()["recording"] is False and not out.exists()
        r = httpx.post(base + "/admin/recording/start", headers=ADMIN_H)
        assert r.status_code == 200 and r.json()["recording"] is True
        assert httpx.post(base + "/admin/recording/start", headers=ADMIN_H).status_code == 409  # never truncated
        chat(3)
        wait_until(lambda: status()["requests"] == 3, 10, "3 recorded requests")
        r = httpx.post(base + "/admin/recording/stop", headers=ADMIN_H)
        assert r.status_code == 200 and r.json()["recording"] is False and r.json()["requests"] == 3
        chat(2)
        assert len(out.read_text().splitlines()) == 3 and status()["requests"] == 3
        assert len(read_trace(out)) == 3  # a valid trace for `gateway replay`
        assert httpx.post(base + "/admin/recording/start", headers=ADMIN_H).status_code == 200
        assert out.read_text() == ""  # a new recording
        chat(1)
        wait_until(lambda: len(out.read_text().splitlines()) == 1, 10, "the new recording's first line")
        cli = [sys.executable, "-m", "gateway.cli", "admin", "--url", base, "--actor", "oncall", "recording", "-o", "json"]
        env = {**env_without_proxies(), "GATEWAY_ADMIN_TOKEN": ADMIN}
        shown = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0 and json.loads(shown.stdout)["recording"] is True
        bad = httpx.post(base + "/admin/recording/pause", headers=ADMIN_H)
        assert 400 <= bad.status_code < 500 and "error" in bad.json()
        assert httpx.post(base + "/admin/recording/stop").status_code == 401
        audit = httpx.get(base + "/admin/audit", headers=ADMIN_H).json()["entries"]
        whats = [e["what"] for e in audit if e["what"].startswith("recording_")]
        assert whats == ["recording_start", "recording_stop", "recording_start"]
        assert all("oncall" in e["who"] for e in audit if e["what"].startswith("recording_"))
    finally:
        gw.stop()
    # no recording.path in the config: the admin API cannot start one (it never picks a file)
    gw2 = start_gateway(config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]}))
    try:
        r = httpx.post(gw2.admin_url + "/admin/recording/start", headers=ADMIN_H)
        assert r.status_code == 409 and r.json()["error"]["param"] == "recording.path"
    finally:
        gw2.stop()
        sims.stop()
