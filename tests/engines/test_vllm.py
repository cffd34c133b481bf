"""The gateway in front of a real vLLM 0.32 server (pool kind `vllm`, docs/engines.md): `gateway check` reads it
(no /server_info), its load comes from /metrics, and precise mode routes from vLLM's own KV events for a salted
tenant (its salt travels in `extra_keys[0]`, its hashes are unsigned 64-bit): speculative entries expire at once,
so a later turn is a prefix hit only through those events. Collected where the vLLM environment is installed."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import parse_config
from gateway.preflight import check_config
from gateway_lab.engines import envs, recipes
from gateway_lab.engines.check import Report, check_server
from gateway_lab.engines.servers import Fleet, start_fleet
from gateway_lab.engines.workload import Session, run_sessions
from tests.gateway_fixtures import KEY_A, config, start_gateway
from tests.support import wait_until

VLLM = envs.env_for(recipes.recipe(os.environ.get("GATEWAY_ENGINE_VLLM", "vllm==0.32.0")))
if not VLLM.ready and os.environ.get("GATEWAY_ENGINE_TESTS") != "1":
    pytest.skip(f"{VLLM.path} not installed (gateway engines install vllm)", allow_module_level=True)


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path) -> Iterator[Fleet]:
    assert VLLM.ready, f"GATEWAY_ENGINE_TESTS=1 but {VLLM.path} is not installed: run `gateway engines install vllm`"
    fleet = start_fleet(VLLM, str(model_dir), 1, Path(tempfile.mkdtemp(prefix="engine-tier-vllm-")))
    report = check_server(fleet.servers[0], model_dir, Report("vllm"))
    if not report.ok:
        fleet.stop()
        pytest.fail(f"engine kit broken (not a gateway failure):\n{report.render()}", pytrace=False)
    yield fleet
    fleet.stop()


def vllm_config(url: str, model_dir: Path, block: int = 64) -> dict[str, Any]:
    """`block`: the server's --block-size (vLLM reports no page size the gateway reads; the kit started it)."""
    pool = {"name": "v", "kind": "vllm", "model": "tiny", "replicas": [{"name": "v-0", "url": url}]}
    routing = {"mode": "precise", "chunk_tokens": 256, "speculative_ttl_s": 0.01,
               "kv_events": {"discovery_interval_s": 0.3, "block_size": block, "speculative_s": 0.01,
                             "tokenizer": {"kind": "hf", "path": str(model_dir)}}}
    return config([pool], routing=routing, timeouts={"connect": 2.0, "first_byte": 120.0, "idle": 60.0,
                                                      "total": 300.0})


def test_gateway_check_reads_a_real_vllm_server(vllm_server: Fleet, model_dir: Path) -> None:
    (rep,) = asyncio.run(check_config(parse_config(vllm_config(vllm_server.urls[0], model_dir))))
    assert rep.ok, rep.findings
    assert rep.facts is not None and rep.facts.version.startswith("0.32") and rep.facts.cache_report is True


def test_precise_mode_from_vllm_events_for_a_salted_tenant(vllm_server: Fleet, model_dir: Path) -> None:
    block = vllm_server.servers[0].flags.page_size
    gw = start_gateway(vllm_config(vllm_server.urls[0], model_dir, block))
    try:
        state = gw.app.app.app.state.gateway  # type: ignore[attr-defined]
        manager = state.kv_events
        wait_until(lambda: manager.health()["healthy"] == 1, timeout=60, what="the subscription healthy")
        assert manager.health()["tokenizer"] == {"v-0": "ok"}
        seen = [0]

        def held() -> int:
            return sum(len(st.blocks) for st in manager.ranks.values())

        def settle() -> None:
            wait_until(lambda: held() > seen[0], timeout=60, what="the turn's KV events applied")
            seen[0] = held()

        sessions = [Session(f"vllm-{i}") for i in range(2)]
        run_sessions(gw.urls[0], sessions, 3, headers={"Authorization": f"Bearer {KEY_A}"}, model="glm-5.2",
                     between=settle)
        for s in sessions:
            assert s.routes[1:] == ["prefix_hit", "prefix_hit"], (s.name, s.routes, manager.health())
            assert all(c >= block for c in s.cached[1:]), (s.name, s.cached)
        sub = manager.health()["subscriptions"]["v-0/rank0"]
        assert sub["apply_errors"] == 0 and sub["orphans"] == 0 and sub["encoding"] == "maps", sub
        assert manager.index.answers.get("events", 0) > 0
        t = state.registry.targets[0]
        assert t.state.version.startswith("0.32") and t.state.engine_load is not None  # /version, /metrics
    finally:
        gw.stop()
