"""The simulator against real SGLang (gateway_lab/engines/differential.py): one real server and one `gateway sim`
started with the same flags and release get the same probes; every observable the gateway depends on must agree,
except the differences kept on purpose (`KNOWN`, each explained in docs/simulator.md). A new difference fails
here, naming the observable and both answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_lab.engines.differential import Endpoint, compare, sim_twin
from gateway_lab.engines.servers import Fleet
from tests.engines.conftest import start_checked


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
