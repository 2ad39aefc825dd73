"""PNG plots for benchmark results (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def bar_plot(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    bars = ax.bar(labels, values, color="#2a7ab9")
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:,.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(report: dict, stem: Path, title: str, bars: dict[str, float], ylabel: str) -> list[Path]:
    """`stem`.json (the report) and `stem`.png (one bar per entry of `bars`)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    return [json_path, bar_plot(stem.with_suffix(".png"), title, list(bars), list(bars.values()), ylabel)]
