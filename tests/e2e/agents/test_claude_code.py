"""Claude Code as shipped (the pinned releases, tests/e2e/agents/pins.json), run non-interactively against the gateway
in a throwaway directory with only its read-only tools (Read, Glob, Grep: no shell, no edits): a three-turn
session that calls tools, its model name left to Claude Code's default (answered by the tenant's `claude-*` alias)
then set, continued with `--continue` on the replica that holds it with growing cache reads; and a bad key that
ends at once with Claude Code's own authentication message."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.e2e.agents.clis import Cli, quiet_env
from tests.e2e.agents.conftest import record
from tests.gateway_fixtures import KEY_A

TOOLS = ["--tools", "Read,Glob,Grep", "--allowedTools", "Read,Glob,Grep"]
RUN_TIMEOUT_S = 240


def run(cli: Cli, project: Path, url: str, key: str, args: list[str], model: str | None = None
        ) -> tuple[subprocess.CompletedProcess[str], float]:
    env = quiet_env(project.parent / "home")
    env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key})
    if model is not None:
        env["ANTHROPIC_MODEL"] = model
    t0 = time.monotonic()
    out = subprocess.run([str(cli.bin), *args], cwd=project, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


def events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def result_of(evs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in reversed(evs) if e.get("type") == "result")


def tool_uses(evs: list[dict[str, Any]]) -> list[str]:
    return [b["name"] for e in evs if e.get("type") == "assistant"
            for b in e["message"]["content"] if b.get("type") == "tool_use"]


def test_three_turn_session_with_tools_continues_on_one_replica(claude, project, stack):
    """Turn 1 (`-p`, stream-json, no model named: the alias), turn 2 (`--continue`, text output, ANTHROPIC_MODEL set)
    and turn 3 (`--continue`, stream-json): each completes, tools are called and answered, every request lands on
    the first turn's replica, and each continued turn reads more of the conversation from its cache."""
    log, url = stack["log"], stack["url"]
    mark = len(log.lines)
    first, t1 = run(claude, project, url, KEY_A, ["-p", "Read calc.py and tell me what it does.",
                                                   "--output-format", "stream-json", "--verbose", *TOOLS])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    evs1 = events(first.stdout)
    assert result_of(evs1)["is_error"] is False and tool_uses(evs1)
    assert any(b.get("type") == "tool_result" for e in evs1 if e.get("type") == "user"
               for b in e["message"]["content"])
    turn1 = log.since(mark, "messages")
    assert turn1 and all(r["status"] == "200" for r in turn1)
    assert all((r["requested_model"] or "").startswith("claude-") for r in turn1)  # Claude Code's default name

    mark2 = len(log.lines)
    second, t2 = run(claude, project, url, KEY_A, ["--continue", "-p", "Now look at README.md too.", *TOOLS],
                     model="glm-5.2")
    assert second.returncode == 0 and second.stdout.strip(), second.stdout[-2000:] + second.stderr[-2000:]
    turn2 = log.since(mark2, "messages")
    assert turn2 and all(r["status"] == "200" and r["requested_model"] is None for r in turn2)

    mark3 = len(log.lines)
    third, t3 = run(claude, project, url, KEY_A, ["--continue", "-p", "Summarise both files.",
                                                   "--output-format", "stream-json", "--verbose", *TOOLS],
                    model="glm-5.2")
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    evs3 = events(third.stdout)
    assert result_of(evs3)["is_error"] is False and tool_uses(evs3)
    turn3 = log.since(mark3, "messages")
    assert turn3 and all(r["status"] == "200" for r in turn3)

    replicas = {r["replica"] for r in turn1 + turn2 + turn3}
    assert len(replicas) == 1, replicas
    cached = [turn1[0]["cached_tokens"], turn2[0]["cached_tokens"], turn3[0]["cached_tokens"]]
    assert cached[0] < cached[1] < cached[2], cached
    assert result_of(evs3)["usage"]["cache_read_input_tokens"] > 0
    record({"client": claude.label, "check": "3 turns with tools, --continue", "ok": True,
            "requests": len(turn1 + turn2 + turn3), "cached_tokens": cached, "replicas": len(replicas),
            "seconds": [round(t1, 1), round(t2, 1), round(t3, 1)]})


def test_a_bad_key_ends_at_once_with_the_auth_message(claude, project, stack):
    """The 401 says `x-should-retry: false`, so Claude Code does not retry with backoff: the gateway sees the one
    request, and the CLI ends with its authentication message."""
    log, url = stack["log"], stack["url"]
    mark = len(log.lines)
    out, took = run(claude, project, url, "sk-not-a-key", ["-p", "hello", "--output-format", "json", *TOOLS])
    assert out.returncode != 0
    res = result_of(events(out.stdout))
    assert res["is_error"] is True and "authenticate" in res["result"].lower() and "401" in res["result"]
    refused = [r for r in log.since(mark) if r["status"] == "401"]
    assert len(refused) == 1, refused  # no retries
    record({"client": claude.label, "check": "bad key: one request, auth message", "ok": True, "requests": len(refused),
            "seconds": round(took, 1)})
