"""The agent CLI tier: a gateway on free loopback ports in front of two simulated replicas, one tenant whose
aliases answer the CLIs' own model names, and every request the gateway logs collected for the assertions.

Versions: the pins (tests/e2e/agents/pins.json), or `GATEWAY_AGENT_VERSIONS` (`claude-code=2.1.332,2.1.153;codex=0.171.0`,
what the compatibility run and the newest-version check set). Without npm the tier is skipped, saying why."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gateway.config import hash_key
from tests.e2e.agents.clis import CLAUDE, CODEX, Cli, install, pins
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

ALIASES = [{"match": "claude-*", "model": "glm-5.2"}, {"match": "gpt-*", "model": "glm-5.2"}]
PROJECT = {"calc.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
           "README.md": "# calc\n\nTwo functions: add and mul.\n"}


def versions(package: str) -> list[str]:
    raw = os.environ.get("GATEWAY_AGENT_VERSIONS")
    if not raw:
        return pins()[package]
    short = package.rsplit("/", 1)[-1]
    for part in raw.split(";"):
        name, _, vs = part.partition("=")
        if name.strip() == short:
            return [v.strip() for v in vs.split(",") if v.strip()]
    return []


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, package in (("claude_version", CLAUDE), ("codex_version", CODEX)):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, versions(package))


def _cli(package: str, version: str) -> Cli:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: Claude Code and Codex cannot be installed from npm")
    return install(package, version)


@pytest.fixture
def claude(claude_version: str) -> Cli:
    return _cli(CLAUDE, claude_version)


@pytest.fixture
def codex(codex_version: str) -> Cli:
    return _cli(CODEX, codex_version)


class RequestLog(logging.Handler):
    """The gateway's one-line request log, parsed (the gateway runs in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(json.loads(record.getMessage()))
        except ValueError:
            pass

    def since(self, mark: int, api: str | None = None) -> list[dict[str, Any]]:
        return [ln for ln in self.lines[mark:] if api is None or ln.get("api") == api]


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(2, time_scale=50.0)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)], tenants=[
        {"name": "agents", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"], "model_aliases": ALIASES}]),
        served=True)  # the listener `gateway serve` runs: Codex's WebSocket handshake meets what it meets in use
    log = RequestLog()
    logger = logging.getLogger("gateway.requests")
    logger.addHandler(log)
    yield {"url": gw.urls[0], "log": log, "gw": gw}
    logger.removeHandler(log)
    gw.stop()
    sims.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A throwaway directory with two small files for the agents to read; HOME lives beside it."""
    proj = tmp_path / "proj"
    proj.mkdir()
    for name, text in PROJECT.items():
        (proj / name).write_text(text)
    (tmp_path / "home").mkdir()
    return proj


def record(result: dict[str, Any]) -> None:
    """One line of the compatibility table (tests/e2e/agents/compat.py), when that run asked for it."""
    out = os.environ.get("GATEWAY_AGENT_COMPAT_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
