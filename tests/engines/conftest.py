"""The engine tier: the gateway against real SGLang servers on the CPU (docs/engines.md).

Every SGLang test runs once per release: the current 0.5.23 by default, or those GATEWAY_ENGINE_SGLANG names
(comma-separated). The default `make test` runs it where that release's environment is installed (`gateway engines
install ...`), and nothing here on a machine with none; `make engine-test` adds the older 0.5.13.post1 (each release
costs the suite's worker two server starts, over a minute on 2 cores: the CI budget holds the current one), installs
what is missing and sets GATEWAY_ENGINE_TESTS=1, under which a missing environment is a failure, never a skip; GATEWAY_ENGINE_TESTS=0 leaves
the tier out even where it is installed. Every test here is marked `engines` (`-m "not engines"` leaves them out
anywhere).

Before any gateway assertion the kit checks itself against one server with no gateway in the path
(gateway_lab/engines/check.py): when that fails, every test fails saying the kit is broken, not the gateway.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway_lab.engines import envs, recipes
from gateway_lab.engines.check import Report, check_server
from gateway_lab.engines.cli import ensure_model
from gateway_lab.engines.servers import Fleet, start_fleet

# the releases the tier runs against: GATEWAY_ENGINE_SGLANG names them (comma-separated; `make engine-test` names the
# current one and the older one that differs, docs/engines.md); by default the current one, where it is installed
NAMED = os.environ.get("GATEWAY_ENGINE_SGLANG")
RELEASES = [r.strip() for r in NAMED.split(",") if r.strip()] if NAMED else ["sglang==0.5.23"]
REQUIRED = os.environ.get("GATEWAY_ENGINE_TESTS") == "1"
EXCLUDED = os.environ.get("GATEWAY_ENGINE_TESTS") == "0"


def _env(spec: str) -> envs.EngineEnv:
    return envs.env_for(recipes.recipe(spec))


READY = [] if EXCLUDED else [r for r in RELEASES if _env(r).ready]
if REQUIRED and not EXCLUDED and len(READY) < len(RELEASES):
    missing = [r for r in RELEASES if r not in READY]
    raise pytest.UsageError(f"GATEWAY_ENGINE_TESTS=1 but {', '.join(missing)} not installed: "
                            f"run `gateway engines install {' '.join(missing)}`")
if not READY:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/" in str(item.fspath):
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_model()


@pytest.fixture(scope="session", params=READY, ids=lambda spec: spec.split("==")[-1])
def sglang_env(request: pytest.FixtureRequest) -> envs.EngineEnv:
    """Each installed release in turn: every SGLang test of the tier runs once per release."""
    return _env(request.param)


def start_checked(env: envs.EngineEnv, model_dir: Path, n: int, **flags: object) -> Fleet:
    """N servers; the first one passes the kit's self-check before a test sees any (else: kit broken)."""
    logs = Path(tempfile.mkdtemp(prefix="engine-tier-"))
    fleet = start_fleet(env, str(model_dir), n, logs, flags=flags or None)
    report = check_server(fleet.servers[0], model_dir, Report(env.recipe.engine))
    if not report.ok:
        fleet.stop()
        pytest.fail(f"engine kit broken (not a gateway failure):\n{report.render()}", pytrace=False)
    return fleet


@pytest.fixture(scope="module")
def two_sglang(sglang_env: envs.EngineEnv, model_dir: Path) -> Iterator[Fleet]:
    fleet = start_checked(sglang_env, model_dir, 2)
    yield fleet
    fleet.stop()


def server_page_size(url: str) -> int:
    """The page size a real SGLang server reports (`/server_info`, `/get_server_info` where that is all it serves):
    the kit starts each release with its own (docs/engines.md), so the tier never assumes one."""
    for path in ("/server_info", "/get_server_info"):
        r = httpx.get(url + path, timeout=30)
        if r.status_code == 200:
            return int(r.json()["page_size"])
    raise AssertionError(f"{url}: neither /server_info nor /get_server_info answered")


@pytest.fixture(scope="module")
def page(two_sglang: Fleet) -> int:
    sizes = {server_page_size(url) for url in two_sglang.urls}
    assert sizes == {two_sglang.servers[0].flags.page_size}, (sizes, two_sglang.servers[0].flags)
    return sizes.pop()
