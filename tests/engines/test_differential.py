"""The simulator against real SGLang (gateway_lab/engines/differential.py): one real server and one `gateway sim`
started with the same flags and release get the same probes; every observable the gateway depends on must agree,
except the differences kept on purpose (`KNOWN`, each explained in docs/simulator.md). A new difference fails
here, naming the observable and both answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_lab.engines.differential import Endpoint, compare, compare_gateways, sim_twin
from gateway_lab.engines.servers import Fleet
from tests.engines.conftest import start_checked
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import wait_until


@pytest.fixture(scope="module")
def twins(sglang_env, model_dir: Path) -> Iterator[tuple[Endpoint, Endpoint]]:  # type: ignore[no-untyped-def]
    fleet: Fleet = start_checked(sglang_env, model_dir, 1)
    real = fleet.servers[0]
    try:
        with sim_twin(real, model_dir, sglang_env.recipe.version) as (sim, _):
            yield Endpoint(real.url, real.kv_endpoint), sim
    finally:
        fleet.stop()


def test_the_simulator_answers_as_real_sglang_does(twins: tuple[Endpoint, Endpoint]) -> None:
    rows = compare(*twins)
    unexplained = [f"{r.area} / {r.item}: real {r.real} | sim {r.sim}" for r in rows if not r.same and not r.note]
    assert not unexplained, "\n".join(unexplained)
    assert len(rows) > 60


def test_bad_input_through_the_gateway_gets_the_same_answers(twins: tuple[Endpoint, Endpoint], model_dir: Path
                                                             ) -> None:
    """A client of the gateway cannot tell the simulator from real SGLang by its mistakes: each bad request sent to
    a gateway in front of the real server and to one in front of its simulator twin gets the same status and error
    (type, code, param), whether the gateway refuses it itself or relays the engine's answer. The pools know the
    model's vocabulary, so the token id past it (fatal to real SGLang when sent bare) is refused at the edge."""
    real, sim = twins
    gws = []
    try:
        for url in (real.url, sim.url):
            pool = {**sglang_pool("p", [url], model="tiny"), "vocab_size": 2048}
            gws.append(start_gateway(config([pool], timeouts={"first_byte": 120.0, "idle": 60.0, "total": 300.0})))
        # the context length the preflight reads from /server_info bounds max_tokens at the edge
        targets = [t for gw in gws for t in gw.app.state.gateway.registry.targets]  # type: ignore[attr-defined]
        wait_until(lambda: all(t.context_tokens == 4096 for t in targets), 60, "the servers' context length")
        rows = compare_gateways(gws[0].urls[0], gws[1].urls[0], {"Authorization": f"Bearer {KEY_A}"}, "glm-5.2")
        differ = [f"{r.item}: real {r.real} | sim {r.sim}" for r in rows if not r.same]
        assert not differ, "\n".join(differ)
        vocab = next(r for r in rows if r.item == "token id past the vocabulary")
        assert vocab.real.startswith("400 ") and "token_id_out_of_vocabulary" in vocab.real, vocab
        assert httpx.get(f"{real.url}/health", timeout=30).status_code == 200  # the real server outlived it all
    finally:
        for gw in gws:
            gw.stop()
