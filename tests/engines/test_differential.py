"""The simulator against real SGLang (gateway_lab/engines/differential.py): one real server and one `gateway sim`
started with the same flags and release get the same probes; every observable the gateway depends on must agree,
except the differences kept on purpose (`KNOWN`, each explained in docs/simulator.md). A new difference fails
here, naming the observable and both answers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_lab.engines.differential import Endpoint, compare
from gateway_lab.engines.recipes import ServerFlags, sim_argv
from gateway_lab.engines.servers import Fleet, free_port_pair
from tests.engines.conftest import start_checked


@pytest.fixture(scope="module")
def twins(sglang_env, model_dir: Path) -> Iterator[tuple[Endpoint, Endpoint]]:  # type: ignore[no-untyped-def]
    fleet: Fleet = start_checked(sglang_env, model_dir, 1)
    real = fleet.servers[0]
    port = free_port_pair({real.flags.port, real.flags.kv_port})
    kv = free_port_pair({port, port + 1, real.flags.port, real.flags.kv_port})
    sim = subprocess.Popen([sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main(sys.argv[1:]))",
                            *sim_argv(ServerFlags(port=port, kv_port=kv, model=str(model_dir)))])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert sim.poll() is None and time.monotonic() < deadline, "gateway sim did not start"
            time.sleep(0.2)
        yield Endpoint(real.url, real.kv_endpoint), Endpoint(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv}")
    finally:
        sim.terminate()
        sim.wait(10)
        fleet.stop()


def test_the_simulator_answers_as_real_sglang_does(twins: tuple[Endpoint, Endpoint]) -> None:
    rows = compare(*twins)
    unexplained = [f"{r.area} / {r.item}: real {r.real} | sim {r.sim}" for r in rows if not r.same and not r.note]
    assert not unexplained, "\n".join(unexplained)
    assert len(rows) > 60
