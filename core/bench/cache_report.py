"""Writing the cache benchmark's JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

from wicore.bench.report import gpu_slug


def write_cache_report(report: dict, folder: Path) -> list[Path]:
    from wicore.bench.eviction_sim import plot_hit_rates

    folder.mkdir(parents=True, exist_ok=True)
    simulation = report.pop("_simulation", None)
    stem = folder / f"cache-gemma3-4b-{gpu_slug(report['gpu'])}"
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    paths = [json_path, plot_cache(report, stem.with_suffix(".png"))]
    if simulation is not None:
        paths.append(plot_hit_rates(simulation, folder / "cache-policies.png"))
    return paths


def plot_cache(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["vqa"] + report["dup30"]
    labels = [r["name"].replace(" (", "\n(") for r in runs]
    values = [r["requests_per_s"] for r in runs]
    colors = ["#9aa5b1", "#2a7ab9", "#1c5a8a", "#9aa5b1", "#2a7ab9"]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    bars = ax.bar(labels, values, color=colors[: len(values)])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("requests / s")
    ax.set_title(
        f"Tier caches, Gemma-3-4B shape, {report['gpu']}: VQA {report['vqa_speedup']:.1f}x, "
        f"30% duplicates {report['dup30_speedup']:.2f}x,\nCPU-tier restore at "
        f"{_restore_text(report)} of pinned H2D bandwidth",
        fontsize=9,
    )
    ax.tick_params(axis="x", labelsize=7)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _restore_text(report: dict) -> str:
    text = f"{100 * report['restore_bw_fraction']:.0f}%"
    batched = report.get("restore_bw_fraction_batched")
    return text if batched is None else f"{text} (batched copy {100 * batched:.0f}%)"
