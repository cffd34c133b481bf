"""The kit's self-check: is the engine kit sound, with no gateway in the path?

Each step talks to a real server directly and names what it expects. When the engine tier fails, this says on
which side: a broken kit (the environment does not import, the server does not start, a server feature the tier
relies on is missing) or a broken gateway (the kit passes, the tier's gateway assertion fails).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import zmq

from gateway_lab.engines.servers import EngineServer

# ~440 tokens (~7 pages of 64): the repeat must report its whole pages cached
PROBE = " ".join(f"probe {i} of the kit, the cache prefix replica gateway server route" for i in range(24))


@dataclass
class Step:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    engine: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    def render(self) -> str:
        lines = [f"{'ok  ' if s.ok else 'FAIL'} {s.name}: {s.detail}" for s in self.steps]
        verdict = "kit ok" if self.ok else f"kit BROKEN at '{next(s.name for s in self.steps if not s.ok)}'"
        return "\n".join([*lines, f"{self.engine}: {verdict}"])


def _step(report: Report, name: str, fn: Callable[[], str]) -> bool:
    try:
        detail = fn()
        report.steps.append(Step(name, True, detail))
        return True
    except Exception as e:  # noqa: BLE001 - every failure of a step is the step's verdict, reported by name
        report.steps.append(Step(name, False, f"{type(e).__name__}: {e}"[:500]))
        return False


def check_server(server: EngineServer, model_dir: Path, report: Report | None = None) -> Report:
    """The features of a running server the engine tier relies on, each checked directly."""
    report = report or Report(server.engine)
    base = server.url
    c = httpx.Client(timeout=60.0)
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.kv_endpoint)
    try:
        def chat() -> str:
            body = {"model": server.flags.served_name, "messages": [{"role": "user", "content": PROBE}],
                    "max_tokens": 4, "temperature": 0}
            first = c.post(base + "/v1/chat/completions", json=body)
            first.raise_for_status()
            again = c.post(base + "/v1/chat/completions", json=body).json()
            u = again["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            # whole pages of the repeat are cached: at least the prompt less one page (and at least one page)
            page = server.flags.page_size
            want = max(page, int(u["prompt_tokens"]) - page)
            if not isinstance(cached, int) or cached < want:
                raise AssertionError(f"a repeated {u['prompt_tokens']}-token prompt reported cached_tokens={cached}, "
                                     f"expected at least {want} (pages of {page}); is the cache report on?")
            return f"prompt {u['prompt_tokens']} tokens, repeat cached {cached}"

        def tokenize() -> str:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            want = tok.encode(PROBE, add_special_tokens=False).ids
            path = "/v1/tokenize" if server.engine == "sglang" else "/tokenize"
            r = c.post(base + path, json={"model": server.flags.served_name, "prompt": PROBE,
                                          "add_special_tokens": False})
            r.raise_for_status()
            got = r.json().get("tokens")
            if got != want:
                raise AssertionError(f"{path} gave {str(got)[:80]}..., the model's tokenizer {str(want)[:80]}...")
            return f"{path}: {len(got)} ids equal the model's tokenizer"

        def events() -> str:
            deadline = time.monotonic() + 30
            body = {"model": server.flags.served_name, "prompt": PROBE + " events", "max_tokens": 1}
            c.post(base + "/v1/completions", json=body).raise_for_status()
            while time.monotonic() < deadline:
                if sub.poll(1000):
                    frames = sub.recv_multipart()
                    payload = msgspec.msgpack.decode(frames[-1])
                    kinds = [e.get("type") if isinstance(e, dict) else e[0] for e in payload[1]]
                    if "BlockStored" in kinds:
                        return f"BlockStored received on {server.kv_endpoint} (seq {int.from_bytes(frames[-2], 'big', signed=True)})"
                c.post(base + "/v1/completions", json=body)
            raise AssertionError(f"no BlockStored on {server.kv_endpoint} within 30 s")

        _step(report, "chat + cache report", chat)
        _step(report, "tokenizer parity", tokenize)
        _step(report, "KV events", events)
    finally:
        sub.close(0)
        c.close()
    return report
