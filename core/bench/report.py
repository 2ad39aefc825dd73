"""Writing and printing the caption benchmark's report."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wicore.bench.plots import bar_plot


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'NVIDIA H200' -> 'h200'."""
    match = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", name)
    return (match.group(1) if match else re.sub(r"\W+", "-", name)).lower()


def preset_of(report: dict) -> str:
    return report.get("preset", "gemma3-4b")


def run_name(report: dict) -> str:
    """The report's model shape, and its variant unless one image a prompt: 'gemma3-4b-two-images'."""
    variant = report.get("variant", "one-image")
    return preset_of(report) + ("" if variant == "one-image" else f"-{variant}")


def shape_title(report: dict) -> str:
    """'gemma3-27b' -> 'Gemma-3-27B shape'."""
    return f"Gemma-3-{preset_of(report).removeprefix('gemma3-').upper()} shape"


def write_caption_report(report: dict, folder: Path) -> list[Path]:
    """caption-<preset>-<gpu>.json and .png."""
    return write_with_plot(report, folder / f"caption-{run_name(report)}-{gpu_slug(report['gpu'])}", plot_caption)


def write_fp8_report(report: dict, folder: Path) -> list[Path]:
    """caption-<preset>-fp8-<gpu>.json and .png (both modes beside HF's bars)."""
    return write_with_plot(report, folder / f"caption-{run_name(report)}-fp8-{gpu_slug(report['gpu'])}", plot_fp8)


def write_sampling_report(report: dict, folder: Path) -> list[Path]:
    """caption-<preset>-sampling-<gpu>.json and .png (the run without the parameters plotted)."""
    stem = folder / f"caption-{preset_of(report)}-sampling-{gpu_slug(report['gpu'])}"
    return write_with_plot(report, stem, plot_caption)


def write_scaling_report(report: dict, folder: Path) -> list[Path]:
    """caption-<preset>-<gpu>-x<N>.json and .png (caption-<preset>-fp8-<gpu>-x<N> with FP8 GEMMs)."""
    dtype = "fp8-" if report.get("gemm_dtype") == "fp8" else ""
    stem = folder / f"caption-{preset_of(report)}-{dtype}{gpu_slug(report['gpu'])}-x{report['gpus']}"
    return write_with_plot(report, stem, plot_scaling)


def write_with_plot(report: dict, stem: Path, plot) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_name(stem.name + ".json")
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return [json_path, plot(report, stem.with_name(stem.name + ".png"))]


def plot_scaling(report: dict, path: Path) -> Path:
    n, one = report["gpus"], report["images_per_s_1gpu"]
    gpus = f"{n} GPUs" if n > 1 else "1 GPU"
    labels = ["1 GPU\nwicore worker", f"{gpus}\nwicore worker --gpus", f"{n} x 1 GPU\n(perfect)"]
    title = (
        f"{shape_title(report)}{', FP8 GEMMs' if report.get('gemm_dtype') == 'fp8' else ''} on "
        f"{gpu_slug(report['gpu']).upper()}\n{report['scaling']:.2f}x on {gpus} "
        f"({100 * report['scaling_efficiency']:.0f}% of perfect), {report['images_per_gpu']} images per GPU"
    )
    return bar_plot(path, title, labels, [one, report["images_per_s"], n * one], "images / s")


def print_scaling_report(report: dict) -> None:
    table = Table("metric", "value", title=f"wicore bench caption --gpus {report['gpus']} ({report['gpu']})")
    rows = [
        (f"images/s on {report['gpus']} GPU(s) (wicore worker --gpus)", f"{report['images_per_s']:.2f}"),
        ("images/s on 1 GPU (wicore worker)", f"{report['images_per_s_1gpu']:.2f}"),
        ("scaling", f"{report['scaling']:.3f}x ({100 * report['scaling_efficiency']:.1f}% of perfect)"),
        ("errors", str(report["run_1gpu"]["error_count"] + report["run_ngpu"]["error_count"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def plot_fp8(report: dict, path: Path) -> Path:
    ours = {"wicore fast\nbf16": report["bf16"]["images_per_s"], "wicore fast\nFP8 GEMMs": report["images_per_s"]}
    agreement, democap = report["token_agreement_vs_bf16"], report["democap_accuracy"]
    note = (
        f"FP8: {report['fp8_speedup_vs_bf16']:.2f}x bf16, {_times(report['speedup_vs_hf_best'], 1)} HF best, "
        f"{_roofline_share(report, 'the bf16 roofline')}\nsequences equal to bf16's "
        f"{100 * agreement['sequences_identical_share']:.0f}%; demo captioner exact match {democap['bf16']:.3f} "
        f"(bf16) / {democap['fp8']:.3f} (FP8)"
    )
    return plot_caption(report, path, ours, note)


def plot_caption(report: dict, path: Path, ours: dict[str, float] | None = None, note: str = "") -> Path:
    """Bars: ours (default: the report's engine) and HF's batches; the roofline as a line. `note`
    replaces the title's summary line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "images" if report.get("variant", "one-image") == "one-image" else "prompts"
    hf = report[f"hf_{unit}_per_s"] or {}  # None: run without the peer (--no-hf)
    ours = ours or {"wicore\n" + report["engine"]: report[f"{unit}_per_s"]}
    labels = list(ours) + [f"HF generate\nbatch {b}" for b in hf]
    values = list(ours.values()) + list(hf.values())
    fig, ax = plt.subplots(figsize=(7.5, 4.3 if note else 4), dpi=120)
    bars = ax.bar(labels, values, color=["#2a7ab9"] * len(ours) + ["#9aa5b1"] * (len(values) - len(ours)))
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    roof = report["roofline_images_per_s"]
    if roof is not None:
        ax.axhline(roof, color="#c0392b", linestyle="--", linewidth=1)
        ax.annotate(f"roofline {roof:.0f} img/s", (len(values) - 0.5, roof), ha="right", va="bottom", color="#c0392b")
    ax.set_ylabel(f"{unit} / s")
    versus_hf = f"{report['speedup_vs_hf_best']:.1f}x HF best, " if hf else ""
    summary = f"{versus_hf}{_roofline_share(report, 'roofline')}"
    ax.set_title(
        f"{shape_title(report)}, {report['images']} images ({report.get('variant', 'one-image')}), "
        f"{report['new_tokens']} tokens, {report['gpu']}\n" + (note or summary),
        fontsize=10,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _roofline_share(report: dict, name: str) -> str:
    """'61% of roofline', or that the variant has none."""
    share = report["roofline_fraction"]
    return f"no {name} for {report.get('variant')}" if share is None else f"{100 * share:.0f}% of {name}"


def print_caption_report(report: dict) -> None:
    table = Table("metric", "value", title=f"wicore bench caption ({report['gpu']})")
    busy = report["gpu_busy_fraction"]
    roofline = report["roofline_images_per_s"]
    rows = [
        ("variant (images a prompt)", f"{report.get('variant', 'one-image')} ({report.get('images_per_prompt', 1)})"),
        ("images/s (wicore)", f"{report['images_per_s']:.2f}"),
        ("prompts/s (wicore)", f"{report.get('prompts_per_s', report['images_per_s']):.2f}"),
        ("output tokens/s", f"{report['output_tokens_per_s']:.0f}"),
        ("job latency p50 / p99", f"{report['latency_p50_s']:.2f} s / {report['latency_p99_s']:.2f} s"),
        ("GPU busy (a kernel ran, NVML)", "n/a" if busy is None else f"{busy:.3f}"),
        ("roofline images/s", "n/a" if roofline is None else f"{roofline:.1f} ({report['roofline_bound']}-bound)"),
        ("roofline fraction", "n/a" if roofline is None else f"{report['roofline_fraction']:.3f}"),
        ("peak GPU memory (wicore / HF)", f"{_gib(report['peak_gpu_bytes'])} / {_gib(report['hf_peak_gpu_bytes'])}"),
        (
            "weights / peak during their load",
            f"{_gib(report.get('weight_bytes'))} / {_gib(report.get('load_peak_bytes'))}",
        ),
        ("time to ready (worker)", _ready(report)),
        *(_peer_rows(report) if report["hf_images_per_s"] else [("HF generate", "not run (--no-hf)")]),
        ("errors", str(report["error_count"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def print_sampling_report(report: dict) -> None:
    print_caption_report(report)
    variant = report["sampling"]
    table = Table("metric", "plain", "with the parameters", title=f"the same images, the same run: {variant['params']}")
    rows = [
        ("images/s", f"{report['images_per_s']:.2f}", f"{variant['images_per_s']:.2f}"),
        ("output tokens/s", f"{report['output_tokens_per_s']:.0f}", f"{variant['output_tokens_per_s']:.0f}"),
        ("job latency p50", f"{report['latency_p50_s']:.2f} s", f"{variant['latency_p50_s']:.2f} s"),
        ("images/s ratio", "", f"{variant['images_per_s_ratio']:.3f}"),
        ("errors", str(report["error_count"]), str(variant["error_count"])),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def print_fp8_report(report: dict) -> None:
    print_caption_report(report)
    bf16, agreement, democap = report["bf16"], report["token_agreement_vs_bf16"], report["democap_accuracy"]
    table = Table("metric", "bf16", "FP8 GEMMs", title="the same images, the same run")
    rows = [
        ("images/s", f"{bf16['images_per_s']:.2f}", f"{report['images_per_s']:.2f}"),
        (
            "roofline fraction (bf16 roofline)",
            _fraction(bf16["roofline_fraction"]),
            _fraction(report["roofline_fraction"]),
        ),
        ("speedup vs HF best", _times(bf16["speedup_vs_hf_best"]), _times(report["speedup_vs_hf_best"])),
        ("vision / prefill / decode s", _phases(bf16), _phases(report["fp8_phases"])),
        ("weights", _gib(bf16["weight_bytes"]), _gib(report["fp8_phases"]["weight_bytes"])),
        ("sequences equal to bf16's", "", f"{agreement['sequences_identical']}/{agreement['compared']}"),
        ("tokens equal to bf16's (by position)", "", f"{100 * agreement['mean_token_agreement']:.1f}%"),
        ("demo captioner exact match", f"{democap['bf16']:.3f}", f"{democap['fp8']:.3f}"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _phases(stats: dict) -> str:
    return " / ".join(
        f"{stats[k]:.1f}" if stats.get(k) is not None else "n/a" for k in ("vision_s", "prefill_s", "decode_s")
    )


def _peer_rows(report: dict) -> list[tuple[str, str]]:
    return [
        ("HF generate images/s by batch", ", ".join(f"{b}: {v:.2f}" for b, v in report["hf_images_per_s"].items())),
        ("HF generate prompts/s by batch", ", ".join(f"{b}: {v:.2f}" for b, v in report["hf_prompts_per_s"].items())),
        ("HF best output tokens/s", f"{report['hf_best_output_tokens_per_s']:.0f}"),
        (
            "speedup vs HF best / batch 1",
            f"{report['speedup_vs_hf_best']:.2f}x / {report['speedup_vs_hf_batch1']:.1f}x",
        ),
        ("tokens equal to HF best batch", _share(report["parity_vs_hf_best_batch"])),
        *((f"HF batch {b} vs HF best batch", _share(p)) for b, p in report["hf_batches_vs_hf_best_batch"].items()),
    ]


def _ready(report: dict) -> str:
    """'95.2 s (load 41.0, compile 20.1, kv_warm_up 30.0, graph_capture 4.1)'."""
    total, phases = report.get("time_to_ready_s"), report.get("ready_phases_s") or {}
    if total is None:
        return "n/a"
    known = ", ".join(f"{name.removesuffix('_s')} {value:.1f}" for name, value in phases.items() if value is not None)
    return f"{total:.1f} s ({known})"


def _times(ratio: float | None, digits: int = 2) -> str:
    """A speedup, or what stands in for one when its peer did not run (--no-hf)."""
    return "n/a (--no-hf)" if ratio is None else f"{ratio:.{digits}f}x"


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / 2**30:.1f} GiB"


def _share(p: dict) -> str:
    """Identical sequences, and with margins HF's lead where the others turned (a near tie
    there is rounding)."""
    text = f"{p['identical']}/{p['compared']} ({100 * p['share']:.1f}%)"
    if p.get("margins_at_divergence"):
        turns = ", ".join(f"{m:.3g}" for m in p["margins_at_divergence"][:4])
        text += f"; HF's lead where they turn: {turns} (median step {p['median_margin']:.3g})"
    return text


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """A two-column metric / value table on the console."""
    table = Table("metric", "value", title=title)
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
