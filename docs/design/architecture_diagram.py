"""Draws docs/design/architecture.png: one caption job's path through wicore's folders, as a sequence
diagram: a column per folder, a row per step of docs/design/architecture-steps.txt (the step numbers are
those of docs/design/architecture.md).

    python docs/design/architecture_diagram.py          # needs matplotlib (the `bench` or `test` extra)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (folder, import path, its boundary, colour): left to right in the order a job first reaches them.
COLUMNS = [
    ("producer/", "wicore.producer", "no torch", "#9c6fb0"),
    ("Redis", "RQ's records, wicore:* keys", "", "#b35c5c"),
    ("scheduler/", "wicore.scheduler", "no torch", "#6f9a45"),
    ("worker/", "wicore.worker", "Redis meets torch", "#4f8f6a"),
    ("ops/", "wicore.ops", "no Redis", "#b08a35"),
    ("engines/fast/", "wicore.engines.fast", "no Redis", "#5878b0"),
    ("engines/kvcache/", "wicore.engines.kvcache", "no Redis", "#5878b0"),
    ("engines/fast/model/", "wicore.engines.fast.model", "no Redis", "#5878b0"),
    ("ops/attention/", "wicore.ops.attention", "no Redis", "#b08a35"),
]

X_STEP = 2.05  # inches between lifelines
Y_STEP = 0.62  # inches between steps
TOP = 1.55  # inches above the first step: title and column heads
BLUE = "#1f5fa8"
LABEL = {"boxstyle": "square,pad=0.08", "facecolor": "white", "edgecolor": "none"}  # hides the lifelines behind text


def read_steps(path: Path) -> list[tuple[str, str, str, str]]:
    """(step, from column, to column, what happens) per line of `path`: `step | from | to | text`."""
    rows = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    steps = [tuple(part.strip() for part in row.split(" | ", 3)) for row in rows]
    return [(step, source, target, text.replace("\\n", "\n")) for step, source, target, text in steps]


def draw(steps: list[tuple[str, str, str, str]], out: Path) -> None:
    width = X_STEP * len(COLUMNS) + 0.4
    height = TOP + Y_STEP * len(steps) + 0.45
    fig = plt.figure(figsize=(width, height), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # y grows downwards, in inches
    ax.axis("off")
    xs = {name: 0.2 + X_STEP * (i + 0.5) for i, (name, *_) in enumerate(COLUMNS)}
    title = "One caption job's path through wicore's folders"
    ax.text(width / 2, 0.32, title, ha="center", fontsize=17, weight="bold")
    for name, module, boundary, colour in COLUMNS:
        _column(ax, xs[name], height, name, module, boundary, colour)
    for row, (step, source, target, text) in enumerate(steps):
        y = TOP + Y_STEP * (row + 0.6)
        if source == target:
            _note(ax, xs[source], y, step, text)
        else:
            _arrow(ax, xs[source], xs[target], y, step, text)
    fig.savefig(out, facecolor="white")


def _column(ax, x: float, height: float, name: str, module: str, boundary: str, colour: str) -> None:
    ax.plot([x, x], [TOP - 0.15, height - 0.2], color=colour, lw=1.2, ls=(0, (4, 3)), alpha=0.7, zorder=1)
    box = {"boxstyle": "round,pad=0.35", "facecolor": colour + "22", "edgecolor": colour, "lw": 1.4}
    ax.text(x, 0.98, name, ha="center", va="center", fontsize=12, weight="bold", bbox=box, zorder=3)
    detail = module + (f"\n{boundary}" if boundary else "")
    ax.text(x, TOP - 0.3, detail, ha="center", va="center", fontsize=8.5, color="#444444", family="monospace")


def _arrow(ax, x0: float, x1: float, y: float, step: str, text: str) -> None:
    ax.annotate("", xy=(x1, y), xytext=(x0, y), zorder=2,
                arrowprops={"arrowstyle": "-|>", "color": BLUE, "lw": 1.8, "shrinkA": 3, "shrinkB": 3})  # fmt: skip
    ax.text(
        min(x0, x1) + 0.3, y - 0.07, text, ha="left", va="bottom", fontsize=9, linespacing=1.15, bbox=LABEL, zorder=3
    )
    _badge(ax, x0 + (0.16 if x1 > x0 else -0.16), y, step)


def _note(ax, x: float, y: float, step: str, text: str) -> None:
    box = {"boxstyle": "round,pad=0.3", "facecolor": "#ffffff", "edgecolor": BLUE, "lw": 1.2}
    ax.text(x + 0.3, y - 0.02, text, ha="left", va="center", fontsize=9, linespacing=1.15, bbox=box, zorder=3)
    _badge(ax, x, y, step)


def _badge(ax, x: float, y: float, step: str) -> None:
    circle = {"boxstyle": "circle,pad=0.22", "facecolor": BLUE, "edgecolor": BLUE}
    ax.text(x, y, step, ha="center", va="center", fontsize=9, color="white", weight="bold", bbox=circle, zorder=4)


if __name__ == "__main__":
    here = Path(__file__).parent
    draw(read_steps(here / "architecture-steps.txt"), here / "architecture.png")
