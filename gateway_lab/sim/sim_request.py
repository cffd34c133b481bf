"""The scheduler's records (engine.py): a request as a rank holds it, the events it hears, one forward step, and a
rank's counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from gateway_lab.sim.radix_cache import Node


class EventKind(Enum):
    FIRST = "first"  # prefill done: first token exists (TTFT)
    TOKENS = "tokens"  # n more output tokens
    FINISH = "finish"  # finished: reason "length" or "stop"
    ABORT = "abort"  # aborted by the server (message, code)


@dataclass(slots=True)
class Event:
    kind: EventKind
    time: float
    tokens: int = 0
    reason: str = ""
    code: int = 0


@dataclass(eq=False)
class SimRequest:
    rid: str
    keys: list[int]  # chain keys of the prompt's full pages
    prompt_len: int
    output_len: int  # tokens to generate before finishing
    finish_reason: str  # "length" when the cap ends it, else "stop"
    arrival: float
    sink: Callable[[Event], None]
    cached: int = 0
    prefilled: int = 0
    generated: int = 0
    started: bool = False
    done_prefill: bool = False
    finished: bool = False
    frac: float = 0.0
    reserved: int = 0
    unsent: int = 0
    steps_unsent: int = 0
    path: list[Node] = field(default_factory=list)
    first_token_time: float | None = None
    priority: int = 0  # resolved by the server (SGLang's default-lowest rule); used only with priority scheduling
    preempted: int = 0  # times retracted by a higher-priority request

    @property
    def uncached(self) -> int:
        return self.prompt_len - self.cached


@dataclass
class Step:
    kind: str  # "prefill" | "decode"
    duration: float
    model_duration: float  # without faults or jitter: what the timing model says
    picks: list[tuple[SimRequest, int]] = field(default_factory=list)
    batch: list[SimRequest] = field(default_factory=list)


@dataclass
class RankCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prefill_compute_tokens: int = 0
    requests: int = 0
    aborted: int = 0
    prefill_forwards: int = 0
    decode_steps: int = 0
    busy_time: float = 0.0
    last_gen_throughput: float = 0.0
