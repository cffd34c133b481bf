"""`gateway serve` freezes its heap once every listener is up (serve.freeze_heap): a full collection a large body
triggers walks what requests created since, not the ~100k objects of the imports and the app (measured: a 162 ms
gen-2 collection held the GIL, and the event loop, while an 8 MB body was translated)."""

import subprocess
import sys

import yaml

from tests.gateway_fixtures import config, sglang_pool
from tests.support import env_without_proxies, free_port

PROGRAM = """
import asyncio, gc, os, signal, sys
from gateway.app import create_app
from gateway.config import load_config
from gateway.serve import serve_gateway

def started():
    print("frozen", gc.get_freeze_count(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

asyncio.run(serve_gateway(create_app(load_config(sys.argv[1])), "127.0.0.1", int(sys.argv[2]), 1.0,
                          on_started=started))
"""


def test_the_heap_is_frozen_once_the_gateway_serves(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump(config([sglang_pool("p", ["http://127.0.0.1:9"])], admin={"port": free_port()})))
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cfg), str(free_port())], env=env_without_proxies(),
                         capture_output=True, text=True, timeout=60)
    frozen = [line for line in out.stdout.splitlines() if line.startswith("frozen ")]
    assert frozen, out.stdout + out.stderr
    assert int(frozen[0].split()[1]) > 10_000  # the imports and the app: tens of thousands of objects
