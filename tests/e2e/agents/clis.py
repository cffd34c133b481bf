"""The agent CLIs as shipped: pinned versions (tests/e2e/agents/pins.json) installed from npm into a cache that outlives
the checkout (`$XDG_CACHE_HOME/inference-gateway/agent-clis`, else `~/.cache/...`), once per version, under a lock so
parallel test workers never install the same one twice. `python -m tests.e2e.agents.clis` installs every pin (what
`make agent-clis` runs); `--newest` resolves and installs each package's newest release instead.

Every environment built here keeps the CLI off the network but for the gateway on loopback: telemetry, error
reporting, update checks and other non-essential traffic are switched off, and any proxy is bypassed for loopback."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PINS_FILE = Path(__file__).with_name("pins.json")
CLAUDE = "@anthropic-ai/claude-code"
CODEX = "@openai/codex"
BINS = {CLAUDE: "claude", CODEX: "codex"}
INSTALL_TIMEOUT_S = 600


def pins() -> dict[str, list[str]]:
    data: dict[str, list[str]] = json.loads(PINS_FILE.read_text())
    return data


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference-gateway" / "agent-clis"


class NpmMissing(RuntimeError):
    """npm is not installed: the tier is skipped, saying so."""


@dataclass(frozen=True)
class Cli:
    package: str
    version: str
    bin: Path

    @property
    def label(self) -> str:
        return f"{self.package.rsplit('/', 1)[-1]} {self.version}"


def npm() -> str:
    exe = shutil.which("npm")
    if exe is None:
        raise NpmMissing("npm is not installed: the agent CLI tier needs it to install Claude Code and Codex")
    return exe


def newest(package: str) -> str:
    out = subprocess.run([npm(), "view", package, "version"], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def install(package: str, version: str) -> Cli:
    """The CLI's binary, installed into the cache unless already there (its own `--version` says so)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / f"{package.replace('/', '+')}@{version}"
    bin_path = prefix / "node_modules" / ".bin" / BINS[package]
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(bin_path, version):
            exe = npm()
            shutil.rmtree(prefix, ignore_errors=True)
            prefix.mkdir(parents=True)
            print(f"installing {package}@{version} into {prefix}", file=sys.stderr, flush=True)
            env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
                   "npm_config_audit": "false"}
            subprocess.run([exe, "install", "--prefix", str(prefix), "--silent", f"{package}@{version}"], env=env,
                           check=True, timeout=INSTALL_TIMEOUT_S, stdout=subprocess.DEVNULL)
            if not _installed(bin_path, version):
                raise RuntimeError(f"{package}@{version} installed, but {bin_path} does not report that version")
    return Cli(package, version, bin_path)


def _installed(bin_path: Path, version: str) -> bool:
    if not bin_path.exists():
        return False
    try:
        out = subprocess.run([str(bin_path), "--version"], capture_output=True, text=True, timeout=60,
                             env=quiet_env(bin_path.parent))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return version in out.stdout


def quiet_env(home: Path) -> dict[str, str]:
    """A minimal environment: HOME of its own, no proxies for loopback, no credentials of the machine's user, and
    every switch the CLIs have for traffic other than the model API turned off."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "TERM", "USER")}
    env.update({
        "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        # Claude Code
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    })
    (home / ".codex").mkdir(parents=True, exist_ok=True)  # Codex's home (its sessions, for `exec resume`)
    return env


def main(argv: list[str]) -> int:
    """Install the pinned CLIs (or with --newest, each package's newest release); print what is where."""
    try:
        wanted = {p: [newest(p)] for p in pins()} if "--newest" in argv else pins()
        for package, versions in wanted.items():
            for v in versions:
                cli = install(package, v)
                print(f"{cli.label}: {cli.bin}")
    except NpmMissing as e:
        print(f"skipped: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
