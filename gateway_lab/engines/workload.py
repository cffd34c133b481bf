"""Multi-turn sessions sent to real engines, through the gateway or straight to the servers, measured by the
engines' own counters (`usage.prompt_tokens_details.cached_tokens`): the engine tier's affinity checks and
`gateway engines affinity` share it.

A session is a distinct system prompt (~400 tokens, so every session is its own prefix) and turns of ~150 tokens,
each turn's prompt the whole conversation so far (the assistant's replies included), sent one after another.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway_lab.engines.model import _WORDS


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Session:
    name: str
    system_words: int = 300
    turn_words: int = 110
    messages: list[dict[str, Any]] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # who served each turn
    routes: list[str] = field(default_factory=list)  # the gateway's branch per turn ("" straight to a server)
    prompt: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.name)
        self.messages = [{"role": "system", "content": f"{self.name}: " + _text(self.rng, self.system_words)}]

    def next_turn(self) -> list[dict[str, Any]]:
        self.messages.append({"role": "user", "content": _text(self.rng, self.turn_words)})
        return list(self.messages)

    def answered(self, body: dict[str, Any], replica: str, route: str) -> None:
        msg = body["choices"][0]["message"]
        self.messages.append({"role": "assistant", "content": msg.get("content") or ""})
        u = body["usage"]
        self.prompt.append(int(u["prompt_tokens"]))
        self.cached.append(int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        self.replicas.append(replica)
        self.routes.append(route)


@dataclass
class Result:
    label: str
    sessions: list[Session]

    def _later(self) -> tuple[int, int]:
        p = sum(sum(s.prompt[1:]) for s in self.sessions)
        c = sum(sum(s.cached[1:]) for s in self.sessions)
        return p, c

    @property
    def hit_rate(self) -> float:
        p = sum(sum(s.prompt) for s in self.sessions)
        return sum(sum(s.cached) for s in self.sessions) / p if p else 0.0

    @property
    def later_hit_rate(self) -> float:
        p, c = self._later()
        return c / p if p else 0.0

    @property
    def moves(self) -> int:
        return sum(sum(1 for a, b in zip(s.replicas, s.replicas[1:]) if a != b) for s in self.sessions)

    def summary(self) -> dict[str, object]:
        return {"label": self.label, "sessions": len(self.sessions), "hit_rate": round(self.hit_rate, 3),
                "later_hit_rate": round(self.later_hit_rate, 3), "moves": self.moves}


def _send(client: httpx.Client, url: str, s: Session, headers: dict[str, str], model: str, max_tokens: int) -> None:
    r = client.post(f"{url}/v1/chat/completions", headers=headers,
                    json={"model": model, "messages": s.next_turn(), "max_tokens": max_tokens, "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
    s.answered(r.json(), r.headers.get("x-gateway-replica", url), r.headers.get("x-gateway-route", ""))


def order(sessions: list[Session], turns: int, by_session: bool) -> list[Session]:
    """The sessions' turns in sending order: interleaved (s1t1, s2t1, ..., s1t2, ...) or one session after
    another (s1t1, s1t2, ..., s2t1, ...)."""
    if by_session:
        return [s for s in sessions for _ in range(turns)]
    return [s for _ in range(turns) for s in sessions]


def run_sessions(url: str, sessions: list[Session], turns: int, headers: dict[str, str] | None = None,
                 model: str = "tiny", max_tokens: int = 4, between: Callable[[], None] | None = None,
                 label: str = "gateway", by_session: bool = False) -> Result:
    """Every turn to one URL (the gateway), in `order`."""
    with httpx.Client(timeout=300) as c:
        for s in order(sessions, turns, by_session):
            _send(c, url, s, headers or {}, model, max_tokens)
            if between is not None:
                between()
    return Result(label, sessions)


def direct_round_robin(urls: list[str], sessions: list[Session], turns: int, model: str = "tiny",
                       max_tokens: int = 4, by_session: bool = False) -> Result:
    """The same order of requests, each sent to the next server in turn (no gateway)."""
    with httpx.Client(timeout=300) as c:
        for i, s in enumerate(order(sessions, turns, by_session)):
            _send(c, urls[i % len(urls)], s, {}, model, max_tokens)
    return Result("round-robin", sessions)
