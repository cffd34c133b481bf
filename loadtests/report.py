"""Tables, JSON and PNG plots for load-test results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "out"


def save_json(name: str, data: Any) -> Path:
    OUT.mkdir(exist_ok=True)
    p = OUT / f"{name}.json"
    p.write_text(json.dumps(data, indent=2, default=str))
    return p


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[h for h in headers]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _save(fig: Any, name: str, title: str) -> Path:
    return save_figure(fig, OUT / f"{name}.png", title)


def save_figure(fig: Any, path: Path, title: str) -> Path:
    """Title, lay out, write as PNG and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ramp(name: str, series: dict[str, list[dict[str, Any]]], title: str, reference: dict[float, tuple[float, float, float]] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in series.items():
        rates = [r["rate"] for r in rows]
        ax1.plot(rates, [r["tok_s"] for r in rows], marker="o", label=label)
        ax2.plot(rates, [r["ttft_p50"] for r in rows], marker="o", label=f"{label} p50")
        ax2.plot(rates, [r["ttft_p95"] for r in rows], marker="s", linestyle="--", label=f"{label} p95")
    if reference:
        rates = sorted(reference)
        ax1.plot(rates, [reference[r][0] for r in rates], marker="x", color="black", label="Wafer (published)")
        ax2.plot(rates, [reference[r][1] for r in rates], marker="x", color="black", label="Wafer p50")
        ax2.plot(rates, [reference[r][2] for r in rates], marker="x", color="gray", linestyle="--", label="Wafer p95")
    ax1.set_xlabel("offered req/s")
    ax1.set_ylabel("output tok/s")
    ax2.set_xlabel("offered req/s")
    ax2.set_ylabel("TTFT (s, simulated)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    return _save(fig, name, title)


def plot_fleet(name: str, series: dict[str, list[dict[str, Any]]], title: str, sla: float) -> Path:
    """The fleet ramp: TTFT p95 (log), share within the SLA and realized hit rate, each against offered req/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for label, rows in series.items():
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_p95"] for r in rows], marker="o", label=label)
        axes[1].plot(rates, [r["sla_met"] * 100 for r in rows], marker="o", label=label)
        axes[2].plot(rates, [r.get("engine_hit", r["cache_hit"]) * 100 for r in rows], marker="o", label=label)
    axes[0].axhline(sla, color="gray", linestyle="--", label=f"SLA {sla} s")
    axes[0].set_yscale("log")
    for ax, yl in zip(axes, ("TTFT p95 (s, simulated)", f"requests with TTFT <= {sla} s (%)",
                             "cache-hit rate, engine counters (%)")):
        ax.set_xlabel("offered req/s")
        ax.set_ylabel(yl)
    axes[1].axhline(99, color="gray", linestyle="--")
    axes[2].axhline(57, color="gray", linestyle="--")
    axes[0].legend(fontsize=7)
    return _save(fig, name, title)


def sustained_rate(rows: list[dict[str, Any]], sla: float) -> float:
    """The highest measured offered rate with TTFT p95 <= sla and 100% success (0 if none). Lenient to a target that
    fails a lower step and passes a higher one (e.g. a router still learning its tree at the first step)."""
    ok = [r["rate"] for r in rows if r["success"] >= 1.0 and r["ttft_p95"] <= sla]
    return max(ok, default=0.0)


def plot_trace_targets(path: Path, results: dict[str, dict[str, Any]], bounds: dict[str, float], sla: float,
                       title: str) -> Path:
    """One trace slice, several routers: TTFT distribution per target (log), realized hit rate against the slice's
    ideal and LRU-bound rates, and the share of requests within the SLA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    names = list(results)
    for name in names:
        t = results[name]["ttfts"]
        axes[0].plot(t, [(i + 1) / len(results[name]["ttfts"]) * 100 for i in range(len(t))], label=name)
    axes[0].axvline(sla, color="gray", linestyle="--", label=f"SLA {sla} s")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("TTFT (s, simulated)")
    axes[0].set_ylabel("requests with TTFT <= x (%)")
    axes[0].legend(fontsize=8)
    x = range(len(names))
    labels = [n.replace(" / ", "\n").replace(" cache_aware", "\ncache_aware").replace(" least", "\nleast") for n in names]
    axes[1].bar(x, [results[n]["engine_hit"] * 100 for n in names], color="tab:blue")
    axes[1].axhline(bounds["lru"] * 100, color="black", linestyle="--", label=f"LRU bound {bounds['lru'] * 100:.1f}%")
    axes[1].axhline(bounds["ideal"] * 100, color="gray", linestyle=":", label=f"ideal {bounds['ideal'] * 100:.1f}%")
    axes[1].set_ylabel("cache-hit rate, engine counters (%)")
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [results[n]["within_sla"] * 100 for n in names], color="tab:green")
    axes[2].set_ylabel(f"requests with TTFT <= {sla} s (%)")
    for ax in axes[1:]:
        ax.set_xticks(list(x), labels, fontsize=7)
    return save_figure(fig, path, title)
