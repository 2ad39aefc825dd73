"""`wicore bench caption --preset <preset> --dtype fp8`: the caption benchmark's product path in
bf16 and with FP8 GEMMs (`gemm_dtype = "fp8"`) on the same images in the same run, HF `generate`
once for both, and what FP8 costs: the share of the 64-token sequences equal to bf16's, and the
demo captioner's exact match through the engine on the GPU in both modes.

The report has the keys of the bf16 benchmark's for the FP8 run (its roofline is bf16's: the
fraction says how far FP8 carries the product against the bf16 compute bound), plus `bf16` (the
bf16 run's figures), `fp8_speedup_vs_bf16`, `token_agreement_vs_bf16` and `democap_accuracy`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from wicore.bench.caption_bench import (
    CaptionBench,
    CaptionRuns,
    bench_command,
    caption_report,
    caption_runs,
    parity,
    run_product,
)

DEMOCAP_IMAGES, DEMOCAP_SEED = 1000, 1000  # the model card's evaluation set (main renderer)
BF16_KEYS = (
    "images_per_s", "roofline_fraction", "speedup_vs_hf_best", "speedup_vs_hf_batch1", "output_tokens_per_s",
    "latency_p50_s", "latency_p99_s", "peak_gpu_bytes", "worker_start_s", "error_count", "gpu_busy_fraction",
    "parity_vs_hf_best_batch",
)  # fmt: skip
PHASES = ("vision_s", "prefill_s", "decode_s", "weight_bytes")  # from the engine's stats


# Engine options of the FP8 mode that would change the bf16 run too: it runs without them, so
# that it stays the model dtype's baseline (vision_attention_dtype needs FP8 GEMMs: no such care).
FP8_MODE_OPTIONS = ("kv_cache_dtype",)


def bf16_variant(bench: CaptionBench) -> CaptionBench:
    options = {key: value for key, value in bench.engine_options.items() if key not in FP8_MODE_OPTIONS}
    return replace(bench, engine_options=options)


def fp8_variant(bench: CaptionBench) -> CaptionBench:
    return replace(bench, engine_options={**bench.engine_options, "gemm_dtype": "fp8"})


def run_fp8_bench(bench: CaptionBench) -> dict:
    runs = caption_runs(bf16_variant(bench))  # bf16 product, HF peers
    fp8 = run_product(fp8_variant(bench), runs.model_dir, runs.warm, runs.timed, bench.workdir / "worker-fp8.log")
    options = bench.engine_options
    accuracy = democap_accuracy(
        bench.device,
        attention=options.get("vision_attention_dtype", "model"),
        kv_cache_dtype=options.get("kv_cache_dtype", "model"),
    )
    return fp8_report(bench, runs, replace(runs, product=fp8), accuracy)


def fp8_report(bench: CaptionBench, bf16_runs: CaptionRuns, fp8_runs: CaptionRuns, democap: dict) -> dict:
    bf16 = caption_report(bf16_variant(bench), bf16_runs)
    report = caption_report(fp8_variant(bench), fp8_runs)
    report["command"] = bench_command(bench, dtype="fp8")
    report["bf16"] = {key: bf16[key] for key in BF16_KEYS} | phases(bf16)
    report["fp8_phases"] = phases(report)
    report["fp8_speedup_vs_bf16"] = report["prompts_per_s"] / bf16["prompts_per_s"]
    report["token_agreement_vs_bf16"] = token_agreement(fp8_runs.product["tokens"], bf16_runs.product["tokens"])
    report["democap_accuracy"] = democap
    return report


def phases(report: dict) -> dict:
    stats = report["engine_stats"]
    return {key: stats.get(key) for key in PHASES}


def token_agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict:
    """Sequences equal to bf16's in all their tokens, the mean share of positions whose tokens are
    equal, and how many tokens the differing ones keep before their first difference."""
    same = parity(ours, theirs)
    common = [k for k in theirs if k in ours]
    positions = [np.mean([a == b for a, b in zip(ours[k], theirs[k])]) if theirs[k] else 1.0 for k in common]
    steps = same["first_divergence_steps"]
    return {
        "compared": same["compared"],
        "sequences_identical": same["identical"],
        "sequences_identical_share": same["share"],
        "mean_token_agreement": float(np.mean(positions)) if positions else float("nan"),
        "median_first_divergence_step": float(np.median(steps)) if steps else None,
    }


def democap_accuracy(
    device: str,
    images: int = DEMOCAP_IMAGES,
    fp8_anywhere: bool = False,
    attention: str = "model",
    kv_cache_dtype: str = "model",
) -> dict:
    """The demo captioner's exact match on its evaluation set through the fast engine, bf16 and
    FP8 GEMMs (`attention`, `kv_cache_dtype`: the FP8 run's vision_attention_dtype and KV pages).
    Eager (compiling two engines of a toy model would take longer than the captions), CUDA graphs
    on; FP8 layers counted (all of its dims are multiples of 16)."""
    from wicore.models.democap import evaluate

    samples = evaluate.main_samples(images, DEMOCAP_SEED)
    result = {"images": images, "seed": DEMOCAP_SEED, "fp8_vision_attention": attention}
    fp8 = {"gemm_dtype": "fp8", "vision_attention_dtype": attention, "kv_cache_dtype": kv_cache_dtype}
    for mode, options in (("bf16", {}), ("fp8", fp8)):
        completions, stats = _democap_run(device, samples, fp8_anywhere, options)
        result[mode] = evaluate.score_completions(samples, completions).accuracy
        result[f"{mode}_kv_dtype"] = stats.get("kv_dtype")
        result[f"{mode}_linears"] = stats.get("fp8_linears", 0)
        result[f"{mode}_attention_layers"] = stats.get("fp8_attention_layers", 0)
        result[f"{mode}_skipped"] = stats.get("fp8_skipped", [])
    return result


def _democap_run(device: str, samples: list, fp8_anywhere: bool, options: dict) -> tuple[list, dict]:
    from wicore.engines.base import EngineConfig
    from wicore.engines.fast import FastEngine
    from wicore.engines.options import FastOptions
    from wicore.models import DEMOCAP_DIR
    from wicore.models.democap import evaluate

    engine_options = FastOptions(compile_vision=False, compile_text=False, num_kv_blocks=16384, **options)
    config = EngineConfig(str(DEMOCAP_DIR), device=device, dtype="bfloat16", max_batch_size=256, cache=False,
                          options=engine_options)  # fmt: skip
    engine = FastEngine(config, fp8_anywhere=fp8_anywhere)
    try:
        return evaluate.engine_captions(engine, samples), engine.stats()
    finally:
        engine.close()
