"""Counters from Prometheus /metrics text (the gateways' and the simulators'), summed over processes: what a load
test reads before and after its window."""

from __future__ import annotations

import httpx


def counter(text: str, name: str, labels: str = "") -> float:
    """Sum of a counter's samples (`name` without _total; its _created samples are not counts)."""
    total = 0.0
    for line in text.splitlines():
        series = line.split("{", 1)[0].split(" ", 1)[0]
        if series in (name, f"{name}_total") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def total(texts: list[str], name: str, labels: str = "") -> float:
    return sum(counter(t, name, labels) for t in texts)


async def metrics_text(c: httpx.AsyncClient, urls: list[str]) -> list[str]:
    """Each server's /metrics; `urls` may be OpenAI bases (…/v1)."""
    return [(await c.get(u.removesuffix("/v1") + "/metrics")).text for u in urls]
