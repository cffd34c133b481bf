"""The floor under a Python relay's CPU per streamed event on this machine: a byte forwarder on uvloop (each read from
one socket written to the other in the protocol's callback: no HTTP parsing, no task, no generator) between the
request_profile client and the stub upstream, its CPU per request counted as request_profile counts the gateway's.

    .venv/bin/python -m loadtests.relay_floor [--tokens 200] [--chunk-interval-ms 2] [--seconds 10]

What a relayed event costs any asyncio relay here whatever its Python does: the loop's wakeup, the read and the write
syscalls (on loopback the write also delivers to the reader). The stub sends one event per `--chunk-interval-ms`, so
each event is one read, as an engine decoding sends them. The request is request_profile's conversation-trace one
(a 13k-token completions prompt, streamed with usage)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson

from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway_lab.replay.http import prompt_for
from loadtests import raw_client
from loadtests.overhead import BODY, KEY
from loadtests.procs import Proc, cpu_seconds

FORWARDER = """
import asyncio, sys, uvloop
up_port, port = int(sys.argv[1]), int(sys.argv[2])

class Up(asyncio.Protocol):
    def __init__(self, down): self.down = down
    def data_received(self, data): self.down.write(data)
    def connection_lost(self, exc): self.down.close()

class Down(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.up, self.pending = t, None, []
        asyncio.ensure_future(self.connect())
    async def connect(self):
        loop = asyncio.get_running_loop()
        self.up, _ = await loop.create_connection(lambda: Up(self.t), "127.0.0.1", up_port)
        for d in self.pending: self.up.write(d)
    def data_received(self, data):
        if self.up is None: self.pending.append(data)
        else: self.up.write(data)
    def connection_lost(self, exc):
        if self.up is not None: self.up.close()

async def main():
    server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
    await server.serve_forever()

uvloop.run(main())
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=13000)
    p.add_argument("--chunk-interval-ms", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--port", type=int, default=18780)
    p.add_argument("--sim-port", type=int, default=18770)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relay-floor-"))
    stub = Proc("stub", [sys.executable, "-m", "loadtests.stub_upstream", "--replicas", "1", "--port", str(a.sim_port),
                         "--chunk-interval-ms", str(a.chunk_interval_ms)],
                f"http://127.0.0.1:{a.sim_port}/health", log=work / "stub.log")
    stub.wait_ready()
    fwd = Proc("forwarder", [sys.executable, "-c", FORWARDER, str(a.sim_port), str(a.port)],
               f"http://127.0.0.1:{a.port}/health", log=work / "forwarder.log")
    try:
        fwd.wait_ready()
        blocks = tuple(range(1, a.prompt_tokens // BLOCK_TOKENS + 2))
        raw = orjson.dumps({"model": BODY["model"], "prompt": prompt_for(TraceRecord(0.0, a.prompt_tokens, a.tokens, blocks)),
                            "max_tokens": a.tokens, "stream": True, "stream_options": {"include_usage": True}})
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        url = f"http://127.0.0.1:{a.port}"
        asyncio.run(raw_client.closed_loop([url], raw, headers, 1, 2.0, path="/v1/completions"))  # warm-up
        cpu0 = cpu_seconds(fwd.pid)
        lat, errors = asyncio.run(raw_client.closed_loop([url], raw, headers, 1, a.seconds, path="/v1/completions"))
        cpu = cpu_seconds(fwd.pid) - cpu0
    finally:
        fwd.stop()
        stub.stop()
    n = max(len(lat), 1)
    events = a.tokens + 2  # the role chunk, the tokens, the usage chunk with [DONE]
    print(f"forwarder, {a.tokens} events {a.chunk_interval_ms} ms apart, {len(lat)} requests, {errors} errors: "
          f"{cpu * 1000 / n:.3f} ms of CPU per request, {cpu * 1e6 / n / events:.1f} us per event "
          f"(at {time.strftime('%H:%M:%S', time.gmtime())} UTC)")


if __name__ == "__main__":
    main()
