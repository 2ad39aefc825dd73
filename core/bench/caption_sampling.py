"""`wicore bench caption --sampling JSON`: the caption benchmark's product path twice on the same
images in the same run: as usual, then with the given generation parameters on every job
(penalties, logprobs, n), each on a fresh worker (so neither reads the other's cached prefixes).
What the sampler's per-row work costs on the device shows as `sampling.images_per_s_ratio`.

The report has the keys of the plain benchmark's (the run without the parameters), plus
`sampling`: the parameters and the figures of the run with them.
"""

from __future__ import annotations

from dataclasses import replace

from wicore.bench.caption_bench import (
    CaptionBench,
    bench_command,
    caption_report,
    caption_runs,
    run_product,
    sampling_words,
)
from wicore.bench.roofline import Ceilings

VARIANT_KEYS = ("images_per_s", "output_tokens_per_s", "latency_p50_s", "latency_p99_s", "error_count", "errors")


def run_sampling_bench(bench: CaptionBench, sampling: dict, ceilings: Ceilings | None = None) -> dict:
    runs = caption_runs(bench, ceilings)  # without the parameters (and the HF peers unless --no-hf)
    variant = replace(bench, sampling=sampling)
    product = run_product(variant, runs.model_dir, runs.warm, runs.timed, bench.workdir / "worker-sampling.log")
    report = caption_report(bench, runs)
    report["command"] = " ".join([bench_command(bench), *sampling_words(sampling)])
    report["sampling"] = {
        "params": sampling,
        **{key: product[key] for key in VARIANT_KEYS},
        "images_per_s_ratio": product["images_per_s"] / report["images_per_s"],
        "output_tokens_per_s_ratio": product["output_tokens_per_s"] / report["output_tokens_per_s"],
        "engine_stats": product["engine_stats"],
    }
    return report
