"""`gateway admin`: an on-call's tool at 3 a.m. It starts fast because it never imports the server (checked on the
modules a real run loaded, in a fresh interpreter), accepts its global flags anywhere on the line, and prints
tables (times in ISO 8601 UTC) unless asked for the API's JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from gateway.cli import build_parser
from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import env_without_proxies, free_port, start_sims

ADMIN = "admin-cli-token"
# what the server is made of: none of it may load for an admin command
SERVER_MODULES = ("fastapi", "starlette", "uvicorn", "pydantic", "redis", "opentelemetry", "litellm", "yaml",
                  "gateway.app", "gateway.config", "gateway.api", "gateway.serve", "gateway.routing", "gateway.state")


def test_an_admin_command_imports_no_server_module():
    """A fresh interpreter runs a whole admin command (parse, HTTP call to a closed port, error) and lists what
    got imported: the CLI and httpx, nothing of the server."""
    code = ("import sys\nfrom gateway.cli import main\n"
            f"rc = main(['admin', 'state', '--url', 'http://127.0.0.1:{free_port()}', '--token', 'x'])\n"
            "print('\\n'.join(sorted(sys.modules)))\nsys.exit(0 if rc == 1 else 3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env_without_proxies())
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "httpx" in loaded and "gateway.admin_cli" in loaded  # it did run the command
    heavy = sorted(m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER_MODULES))
    assert heavy == [], heavy


@pytest.mark.parametrize("argv", [
    ["admin", "--url", "http://a:1", "--token", "t", "-o", "json", "--actor", "ann", "drain", "r-1"],
    ["admin", "drain", "r-1", "--url", "http://a:1", "--token", "t", "-o", "json", "--actor", "ann"],
    ["admin", "--token", "t", "drain", "--url", "http://a:1", "r-1", "--output", "json", "--actor", "ann"],
])
def test_global_flags_are_accepted_anywhere(argv):
    a = build_parser(argv).parse_args(argv)
    assert (a.url, a.token, a.output, a.actor, a.admin_cmd, a.replica) == ("http://a:1", "t", "json", "ann", "drain",
                                                                           "r-1")


def test_defaults_when_no_global_flag_is_given(monkeypatch):
    monkeypatch.delenv("GATEWAY_ADMIN_URL", raising=False)
    a = build_parser(["admin", "state"]).parse_args(["admin", "state"])
    assert a.url == "http://127.0.0.1:8081" and a.output == "table"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**env_without_proxies(), "GATEWAY_ADMIN_TOKEN": ADMIN}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "admin", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_tables_by_default_json_on_request():
    """Against a real gateway's admin listener: `state` is a replica table (not 141 lines of JSON), decisions and
    the audit log show ISO times, `-o json` is the API's JSON; the client port is named when pointed at it."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]}))
    try:
        import httpx

        httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30,
                   json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        state = _cli("state", "--url", gw.admin_url)
        assert state.returncode == 0, state.stderr
        lines = state.stdout.splitlines()
        header = next(ln for ln in lines if ln.startswith("REPLICA"))
        assert header.split()[:4] == ["REPLICA", "POOL", "HEALTHY", "BREAKER"]
        assert any(ln.split()[:2] == ["p-0", "p"] for ln in lines) and any(ln.startswith("p-1 ") for ln in lines)
        assert len(lines) < 20
        as_json = json.loads(_cli("state", "-o", "json", "--url", gw.admin_url).stdout)
        assert [r["name"] for r in as_json["pools"][0]["replicas"]] == ["p-0", "p-1"]
        assert _cli("--url", gw.admin_url, "drain", "p-1").returncode == 0
        audit = _cli("audit", "--url", gw.admin_url).stdout
        assert re.search(r"\s\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\s", audit.splitlines()[1]), audit  # ISO, not epoch
        decisions = _cli("decisions", "--url", gw.admin_url).stdout
        assert decisions.startswith("AT ") and re.search(r"\n\d{4}-\d\d-\d\dT", decisions), decisions
        wrong = _cli("state", "--url", gw.urls[0])  # the client port: no admin there
        assert wrong.returncode == 1 and "admin listener" in wrong.stderr
    finally:
        gw.stop()
        sims.stop()
