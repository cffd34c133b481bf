"""The engine tier: the gateway against real SGLang servers on the CPU (docs/engines.md).

Collected only where the engine kit's SGLang environment is installed (`gateway engines install sglang`), so the
default `make test` on a machine without it runs nothing here; `make engine-test` installs what is missing and sets
GATEWAY_ENGINE_TESTS=1, under which a missing environment is a failure, never a skip; GATEWAY_ENGINE_TESTS=0 leaves
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

SGLANG = os.environ.get("GATEWAY_ENGINE_SGLANG", "sglang==0.5.23")
REQUIRED = os.environ.get("GATEWAY_ENGINE_TESTS") == "1"
EXCLUDED = os.environ.get("GATEWAY_ENGINE_TESTS") == "0"


def _env() -> envs.EngineEnv:
    return envs.env_for(recipes.recipe(SGLANG))


if EXCLUDED:
    collect_ignore_glob = ["test_*.py"]
elif not _env().ready:
    if REQUIRED:
        raise pytest.UsageError(f"GATEWAY_ENGINE_TESTS=1 but {SGLANG} is not installed at {_env().path}: "
                                f"run `gateway engines install {SGLANG}`")
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engines/" in str(item.fspath):
            item.add_marker(pytest.mark.engines)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_model()


@pytest.fixture(scope="session")
def sglang_env() -> envs.EngineEnv:
    return _env()


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
