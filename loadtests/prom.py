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


def admin_url(api_url: str) -> str:
    """A gateway's admin listener (the admin API, /metrics) from its API URL: the API port + 1, `gateway serve`'s
    default (the load tests leave every other port free for it)."""
    u = httpx.URL(api_url.removesuffix("/v1"))
    assert u.port is not None, api_url
    return f"{u.scheme}://{u.host}:{u.port + 1}"


async def gateway_metrics_text(c: httpx.AsyncClient, urls: list[str]) -> list[str]:
    """Each gateway's /metrics, from its admin listener; `urls`: the gateways' API URLs (or OpenAI bases)."""
    return await metrics_text(c, [admin_url(u) for u in urls])
