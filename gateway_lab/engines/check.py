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


EVENTS_BUDGET_S = 120.0


def _kinds(payload: bytes) -> list[str]:
    """The event kinds of one published batch `[ts, events, ...]`: tagged maps (0.5.23, vLLM) or tagged arrays."""
    batch = msgspec.msgpack.decode(payload)
    return [str(e.get("type") if isinstance(e, dict) else e[0]) for e in batch[1]]


def _replayed(endpoint: str) -> str:
    """What the server's replay socket holds from sequence 0: tells 'never published' from 'published, not received'."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    kinds: list[str] = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        while sock.poll(5000):
            frames = sock.recv_multipart()
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                return f"the replay socket holds {len(kinds)} event(s): {sorted(set(kinds))}"
            kinds += _kinds(frames[-1])
        return f"the replay socket did not finish answering ({len(kinds)} event(s) so far)"
    except Exception as e:  # noqa: BLE001 - a diagnosis only, attached to the failure it explains
        return f"the replay socket could not be read ({type(e).__name__}: {e})"
    finally:
        sock.close(0)


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
        report.steps.append(Step(name, False, f"{type(e).__name__}: {e}"[:2000]))
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
            # no wall-clock verdict: on a busy machine one CPU completion can take many seconds, so the budget is
            # generous, every attempt polls after its request returns, and each attempt sends a prompt never seen
            # before from its first token (all pages new, so a BlockStored is due whatever the cache holds)
            deadline = time.monotonic() + EVENTS_BUDGET_S
            attempt = 0
            seen: list[str] = []  # every kind received, for the failure's diagnosis
            while True:
                attempt += 1
                body = {"model": server.flags.served_name, "prompt": f"events {attempt}: {PROBE}", "max_tokens": 1}
                c.post(base + "/v1/completions", json=body).raise_for_status()
                polled_until = time.monotonic() + 5
                while time.monotonic() < polled_until:
                    if sub.poll(500):
                        frames = sub.recv_multipart()
                        kinds = _kinds(frames[-1])
                        seen += kinds
                        if "BlockStored" in kinds:
                            seq = int.from_bytes(frames[-2], "big", signed=True)
                            return f"BlockStored received on {server.kv_endpoint} (seq {seq}, attempt {attempt})"
                if time.monotonic() >= deadline:
                    break
            raise AssertionError(f"no BlockStored on {server.kv_endpoint} after {attempt} new prompts "
                                 f"in {EVENTS_BUDGET_S:.0f} s (received: {sorted(set(seen)) or 'nothing'}); "
                                 f"{_replayed(server.replay_endpoint)}; "
                                 f"log {server.log}:\n{server.log_tail(8)}")

        _step(report, "chat + cache report", chat)
        _step(report, "tokenizer parity", tokenize)
        _step(report, "KV events", events)
    finally:
        sub.close(0)
        c.close()
    return report
