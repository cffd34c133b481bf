"""A new routing policy is one module plus one line in the registry: with no other edit it is accepted (and its
parameters checked) by the config, gets prefix data in the gateway, routes and explains through the admin API, and
replays under `gateway replay --policy`. The test adds one to a copy of the package and drives all four in a fresh
interpreter, so nothing here can lean on a name the rest of the code already knows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

POLICY = '''
"""most_cached — the candidate holding the longest cached prefix, else the least loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, R
from gateway.routing.policy import PolicyContext, PolicyParams, PolicySpec
from gateway.routing.request import RoutingRequest


class Params(PolicyParams):
    type: Literal["most_cached"] = "most_cached"
    min_cached_tokens: int = Field(default=256, ge=1)


class MostCached:
    def __init__(self, p: Params, ctx: PolicyContext) -> None:
        self.p = p

    def __call__(self, req: RoutingRequest, cands: Sequence[Candidate[R]], /) -> Decision[R]:
        ordered = sorted(cands, key=lambda c: (-c.cached_tokens, c.load.inflight, c.name))
        hit = bool(ordered) and ordered[0].cached_tokens >= self.p.min_cached_tokens
        return Decision.of(ordered, "most_cached_hit" if hit else "most_cached_cold", Inputs.of(req))


SPEC = PolicySpec("most_cached", Params, True, MostCached, "the longest cached prefix")
'''

DRIVER = '''
import sys

import httpx

from gateway.cli import main
from gateway.config import ConfigError, hash_key, parse_config
from gateway.recording.trace import TraceRecord, write_trace
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

trace_path = sys.argv[1]

# config validation: the new type and its parameters are part of the schema, with locations in errors
ok = parse_config(config([sglang_pool("p", ["http://127.0.0.1:9"])],
                         routing={"policy": {"type": "most_cached", "min_cached_tokens": 512}}))
assert ok.routing.policy.type == "most_cached" and ok.routing.policy.min_cached_tokens == 512
try:
    parse_config(config([sglang_pool("p", ["http://127.0.0.1:9"])],
                        routing={"policy": {"type": "most_cached", "min_cached_tokns": 1}}))
    raise AssertionError("a misspelt parameter was accepted")
except ConfigError as e:
    assert "routing.policy.min_cached_tokns" in str(e), e

# the gateway: prefix hashes are built for it and the index answers, so the second turn goes where the first was
sims, _ = start_sims(2)
gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "most_cached"},
                          admin={"token_hashes": [hash_key("admin-secret")]}))
try:
    msgs = [{"role": "user", "content": "a shared prefix for the new policy. " * 400}]
    body = {"model": "glm-5.2", "messages": msgs, "max_tokens": 4}
    auth = {"authorization": f"Bearer {KEY_A}"}
    first = httpx.post(gw.urls[0] + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert first.status_code == 200, first.text
    assert first.headers["x-gateway-route"] == "most_cached_cold"
    second = httpx.post(gw.urls[0] + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert second.headers["x-gateway-route"] == "most_cached_hit"
    assert second.headers["x-gateway-replica"] == first.headers["x-gateway-replica"]
    # explain: the same decision, dry run, with the candidates' prefix matches
    r = httpx.post(gw.admin_url + "/admin/explain", json={"tenant": "tenant-a", "request": body},
                   headers={"authorization": "Bearer admin-secret"}, timeout=30)
    d = r.json()["decision"]
    assert d["branch"] == "most_cached_hit" and d["chosen"] == first.headers["x-gateway-replica"], d
    assert d["inputs"]["chunks"] > 0 and max(c["cached_tokens"] for c in d["candidates"]) >= 2048, d
finally:
    gw.stop()
    sims.stop()

# replay: the policy is a --policy choice and routes on the virtual clock with prefix data
recs = [TraceRecord(i * 500.0, 4000, 8, tuple(range(8))) for i in range(12)]
with open(trace_path, "w") as f:
    write_trace(recs, f)
assert main(["replay", trace_path, "--nodes", "1", "--policy", "most_cached", "--no-progress", "--branches"]) == 0
print("new policy: ok")
'''


def test_a_new_policy_needs_one_module_and_one_registry_line(tmp_path: Path) -> None:
    copy = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    for pkg in ("gateway", "gateway_lab"):
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=ignore)
    (copy / "gateway" / "routing" / "policies" / "most_cached.py").write_text(POLICY)
    registry = copy / "gateway" / "routing" / "registry.py"
    text = registry.read_text()
    line = '    _spec("least_loaded"),\n'
    assert text.count(line) == 1
    registry.write_text(text.replace(line, line + '    _spec("most_cached"),\n'))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER), str(tmp_path / "t.jsonl")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "new policy: ok" in out.stdout
    assert "most_cached_hit" in out.stdout  # the replay's branch table: hits found through the prefix index
