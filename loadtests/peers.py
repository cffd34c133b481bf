"""Peer routers in their own virtualenvs (see shared/reference/peers.md): installed on first use, reused after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VENVS = Path(__file__).parent / ".venvs"
PEERS = {
    "sglang-router": ["sglang-router==0.3.2"],
    # 1.106.2 resolves against this index; never 1.82.7/1.82.8 (compromised releases)
    "litellm": ["litellm[proxy]==1.106.2"],
    "vllm-router": ["vllm-router==0.1.17"],
    # a client, not a router: guidellm probes GET /health before benchmarking (issue 19); it requires torch, and
    # torch==2.13.0 is the CPU build this machine carries (a newer one would pull CUDA packages)
    "guidellm": ["torch==2.13.0", "guidellm==0.8.1"],
}


def ensure(name: str, root: Path = VENVS) -> Path | None:
    """The venv's bin dir, installing the peer if needed; None when it cannot be installed here."""
    venv = root / name
    marker = venv / ".installed"
    if marker.exists():
        return venv / "bin"
    root.mkdir(parents=True, exist_ok=True)
    print(f"installing {name} into {venv} (first run only) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEERS[name]], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  {name} did not install: {r.stderr.strip().splitlines()[-1:] or r.returncode}", file=sys.stderr)
        return None
    if name == "litellm":
        bad = list(venv.glob("lib/python*/site-packages/litellm_init.pth"))
        if bad:
            raise RuntimeError(f"refusing to use a litellm install carrying {bad[0]}")
    marker.write_text("ok\n")
    return venv / "bin"
