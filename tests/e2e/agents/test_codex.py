"""Codex CLI as shipped (the pinned release, tests/e2e/agents/pins.json) with its default configuration — the built-in
OpenAI provider on the Responses API, only its base URL pointed at the gateway, its default model (answered by the
tenant's `gpt-*` alias), goals on — in a throwaway directory, read-only sandbox, shell tool off: `codex exec` and
`codex exec resume --last` both complete with tool calls, every turn on one replica reading ever more from its
cache; a bad key ends the run with the gateway's 401."""

from __future__ import annotations

import json
import subprocess
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from tests.e2e.agents.clis import Cli, quiet_env
from tests.e2e.agents.conftest import record
from tests.gateway_fixtures import KEY_A

RUN_TIMEOUT_S = 240


def run(cli: Cli, project: Path, url: str, key: str, args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    env = quiet_env(project.parent / "home")
    env["CODEX_API_KEY"] = key
    # default config but for the endpoint; read-only sandbox, and no tool with an effect outside the turn: no shell
    # (no command runs), no sleep, no sub-agent started (one thread: a spawn is refused); no analytics
    conf = ["-c", f'openai_base_url="{url}/v1"', "-c", 'sandbox_mode="read-only"', "-c", "analytics.enabled=false",
            "--disable", "shell_tool", "--disable", "sleep_tool", "--disable", "multi_agent", "-c", "agents.max_threads=1",
            "--skip-git-repo-check", "--json"]
    t0 = time.monotonic()
    out = subprocess.run([str(cli.bin), "exec", *args[:1], *conf, *args[1:]], cwd=project, env=env,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def rollout(home: Path) -> list[dict[str, Any]]:
    """The response items Codex recorded for its sessions (its own record of every call and output)."""
    items = []
    for f in sorted((home / ".codex" / "sessions").rglob("rollout-*.jsonl")):
        for ln in f.read_text().splitlines():
            rec = json.loads(ln)
            if rec.get("type") == "response_item":
                items.append(rec["payload"])
    return items


def test_exec_and_resume_with_default_config_stay_on_one_replica(codex, project, stack):
    log, url = stack["log"], stack["url"]
    mark = len(log.lines)
    first, t1 = run(codex, project, url, KEY_A, ["Read calc.py and explain it."])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    evs1 = events(first.stdout)
    assert any(e.get("type") == "turn.completed" for e in evs1), first.stdout[-3000:]
    seen1 = log.since(mark, "responses")
    # its WebSocket handshake is told "HTTP here" once (426) and it falls back at once: no handshake retried
    assert [r["status"] for r in seen1 if r.get("method") == "GET"] == ["426"], seen1
    turn1 = [r for r in seen1 if r.get("method") != "GET"]
    assert turn1 and all(r["status"] == "200" for r in turn1), turn1
    assert all((r["requested_model"] or "").startswith("gpt-") for r in turn1)  # Codex's default model name
    assert len(turn1) >= 2, first.stdout[-4000:]  # a tool call, then the answer to its output

    mark2 = len(log.lines)
    second, t2 = run(codex, project, url, KEY_A, ["resume", "--last", "Now read README.md as well."])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    evs2 = events(second.stdout)
    assert any(e.get("type") == "turn.completed" for e in evs2)
    seen2 = log.since(mark2, "responses")
    assert [r["status"] for r in seen2 if r.get("method") == "GET"] == ["426"], seen2
    turn2 = [r for r in seen2 if r.get("method") != "GET"]
    assert turn2 and all(r["status"] == "200" for r in turn2), turn2
    items = rollout(project.parent / "home")
    calls = [i["name"] for i in items if i.get("type") in ("function_call", "custom_tool_call")]
    outputs = {i.get("call_id") for i in items if i.get("type") in ("function_call_output", "custom_tool_call_output")}
    assert calls and all(i.get("call_id") in outputs for i in items
                         if i.get("type") in ("function_call", "custom_tool_call")), items

    replicas = {r["replica"] for r in turn1 + turn2}
    assert len(replicas) == 1, replicas
    cached = [r["cached_tokens"] for r in turn1 + turn2]
    assert all(b >= a for a, b in pairwise(cached)) and cached[-1] > cached[0], cached
    record({"client": codex.label, "check": "exec + resume, default config, tools", "ok": True,
            "requests": len(turn1 + turn2), "cached_tokens": cached, "replicas": len(replicas), "tool_calls": calls,
            "seconds": [round(t1, 1), round(t2, 1)]})


def test_a_bad_key_ends_the_run_with_the_401(codex, project, stack):
    """Codex retries a 401 on its own fixed budget (it reads no x-should-retry): the run still ends, with the
    gateway's 401 as its error, after at most that budget of attempts."""
    log, url = stack["log"], stack["url"]
    mark = len(log.lines)
    out, took = run(codex, project, url, "sk-not-a-key", ["hello"])
    assert out.returncode != 0
    failed = [e for e in events(out.stdout) if e.get("type") == "turn.failed"]
    assert failed and "401" in failed[-1]["error"]["message"], out.stdout[-2000:]
    refused = [r for r in log.since(mark) if r["status"] == "401" and r["api"] == "responses"
               and r.get("method") != "GET"]  # its POSTs; each WebSocket handshake before them is refused too
    assert 1 <= len(refused) <= 6, [(r.get("method"), r.get("endpoint"), r.get("error")) for r in refused]
    record({"client": codex.label, "check": "bad key ends the run", "ok": True, "requests": len(refused),
            "seconds": round(took, 1)})
