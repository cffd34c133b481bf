"""Preflight (issue #11): every SGLang setting that makes the gateway go quietly wrong is named — by
`gateway check --config FILE` (exit 1), in a log line, in /readyz and in a metric — on a simulator started with it."""

import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.gateway_fixtures import config, sglang_pool, start_gateway
from tests.support import env_without_proxies, free_port, start_sims, wait_until

ROOT = Path(__file__).resolve().parents[1]

# server -> (simulator settings, pool settings, the check gateway check must name)
CASES = {
    "good": ({}, {}, None),
    "no-cache-report": ({"enable_cache_report": False}, {}, "cache_report"),
    "priority-unsent": ({"enable_priority_scheduling": True}, {"send_priority": "never"}, "priority"),
    "priority-refused": ({"abort_on_priority_when_disabled": True}, {"send_priority": "always"}, "priority"),
    "dp-unpinned": ({"dp_size": 2}, {"dp_pinning": "off"}, "dp_pinning"),
    "dp-attn-unpinned": ({"dp_size": 2, "enable_dp_attention": True}, {"dp_pinning": "off"}, "dp_pinning"),
    "header-on-059": ({"dp_size": 2, "sglang_version": "0.5.9"}, {"dp_pinning": "header"}, "dp_pinning"),
    "page-48": ({"page_size": 48}, {}, "page_size"),
    "short-context": ({"context_length": 131_072}, {"context_tokens": 1_048_576}, "context_length"),
    "old-version": ({"version": "0.4.6"}, {}, "version"),
    "wrong-key": ({"api_key": "sk-right"}, {"api_key_env": "H4_PREFLIGHT_WRONG_KEY"}, "api_key"),
}


def _pool(name: str, url: str, extra: dict) -> dict:
    return {**sglang_pool(name, [url]), **extra}


def test_gateway_check_names_each_misconfiguration(tmp_path):
    started = []
    pools = []
    try:
        for name, (sim, pool, _) in CASES.items():
            sim = dict(sim)
            version = sim.pop("sglang_version", "0.5.23")
            st, _ = start_sims(1, sglang_version=version, **{"enable_cache_report": True, **sim})
            started.append(st)
            pools.append(_pool(name, st.urls[0], pool))
        pools.append(_pool("down", f"http://127.0.0.1:{free_port()}", {}))
        cfg = config(pools)
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**env_without_proxies(), "H4_PREFLIGHT_WRONG_KEY": "sk-wrong"}
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "check", "--config", str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120, check=False)
        out = r.stdout
        assert r.returncode == 1, out + r.stderr
        for name, (_, _, check) in CASES.items():
            mine = [ln for ln in out.splitlines() if ln.strip().startswith(f"{name}/{name}-0:")]
            if check is None:
                assert not mine and f"ok    {name}/{name}-0" in out, out
            else:
                assert any(f": {check}: " in ln for ln in mine), (name, out)
                assert {ln.split(": ")[1] for ln in mine} == {check}, (name, mine)  # that one, nothing else
        assert "down/down-0: reachable: " in out
    finally:
        for st in started:
            st.stop()


def test_gateway_check_passes_a_well_configured_pool(tmp_path):
    st, _ = start_sims(2)
    try:
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(config([sglang_pool("p", st.urls)])))
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "check", "--config", str(path)], cwd=ROOT,
                           env=env_without_proxies(), capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "2 server(s), 0 hosted pool(s), 0 misconfiguration(s)" in r.stdout
        assert "schedule policy fcfs" in r.stdout  # what on-call needs to read the ranks' queue order
    finally:
        st.stop()


def test_a_running_gateway_names_misconfigured_replicas_in_readyz_metrics_and_logs(caplog):
    """At start the poller's preflight finds the missing cache report: one event line, the gauge at 1, a /readyz
    detail — and the instance stays ready (a misconfigured replica still serves). Fixed while it runs (no restart),
    the finding clears at the next reconcile: readyz, the gauge and a `replica_preflight_ok` line."""
    sims, _ = start_sims(1, enable_cache_report=False)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"load_poll_s": 0.1}))
    try:
        def ready():
            return httpx.get(f"{gw.urls[0]}/readyz").json()

        wait_until(lambda: "misconfigured_replicas" in ready(), timeout=10, what="the preflight")
        body = ready()
        assert body["status"] == "ready" and body["misconfigured_replicas"] == {"p-0": ["cache_report"]}
        metrics = httpx.get(f"{gw.admin_url}/metrics").text
        assert 'gateway_replica_misconfigured{check="cache_report",pool="p",replica="p-0"} 1.0' in metrics
        events = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "replica_misconfigured"]
        assert len(events) == 1 and events[0]["replica"] == "p-0" and events[0]["check"] == "cache_report"
        assert "--enable-cache-report" in events[0]["message"]
        httpx.post(sims.urls[0] + "/_sim/config", json={"enable_cache_report": True}).raise_for_status()
        wait_until(lambda: "misconfigured_replicas" not in ready(), timeout=15, what="the finding cleared")
        metrics = httpx.get(f"{gw.admin_url}/metrics").text
        assert 'gateway_replica_misconfigured{check="cache_report",pool="p",replica="p-0"} 0.0' in metrics
        ok = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "replica_preflight_ok"]
        assert ok and ok[0]["cleared"] == ["cache_report"]
    finally:
        gw.stop()
        sims.stop()


def test_preflight_reads_the_facts_and_probes_the_cache_report():
    import asyncio

    from gateway.config import parse_config
    from gateway.preflight import inspect

    sims, _ = start_sims(1, enable_cache_report=False)
    try:
        cfg = parse_config(config([sglang_pool("p", sims.urls)]))
        rep = asyncio.run(inspect(httpx.AsyncClient(trust_env=False), cfg.pools[0], "p-0", sims.urls[0], None, 256))
        assert rep.checks() == ["cache_report"]
        facts = rep.facts
        assert facts is not None and facts.version == "0.5.23" and facts.context_length == 1_048_576
    finally:
        sims.stop()


def test_cache_report_from_the_probe_when_server_info_does_not_say():
    """A /server_info without `enable_cache_report` (a trimmed build) is judged by the text probe's usage: null
    prompt_tokens_details = off; `{"cached_tokens": 0}` on a text prompt = on (only a multimodal prompt shows a 0
    without the flag, which is why the probe is text only)."""
    from gateway.config import parse_config
    from gateway.preflight import ServerFacts, assess

    pool = parse_config(config([sglang_pool("p", ["http://127.0.0.1:1"])])).pools[0]
    silent = ServerFacts(version="0.5.23", page_size=64)
    assert [f.check for f in assess(silent, pool, 256, {"prompt_tokens_details": None})] == ["cache_report"]
    assert assess(silent, pool, 256, {"prompt_tokens_details": {"cached_tokens": 0}}) == []
    assert assess(silent, pool, 256, None) == []  # no probe answer: nothing claimed
    # /server_info says on: a null in the probe is 0.5.13's way of saying nothing was cached, not a finding
    on_0513 = ServerFacts(version="0.5.13.post1", page_size=64, cache_report=True)
    assert assess(on_0513, pool, 256, {"prompt_tokens_details": None}) == []
