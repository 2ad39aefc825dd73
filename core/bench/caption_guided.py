"""Guided outputs on the GPU: the same images captioned free and with a JSON schema on every
job, one after the other in one run (`wicore bench caption --guided-schema FILE`), each on a
fresh worker: images/s and output tokens/s of both and their ratios.

The free side generates exactly new_tokens per image (ignore_eos, as every caption bench); a
guided job ends with its grammar (at most new_tokens), so its output tokens/s is the fairer
per-token figure and images/s the one users feel. Both are reported.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from wicore.bench.caption_bench import CaptionBench, device_name, make_images, run_product

KEYS = (
    "images",
    "seconds",
    "images_per_s",
    "output_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "error_count",
    "errors",
)


def load_schema(path: Path) -> dict:
    """The schema file as a `guided` spec; ConfigError when it is not one."""
    from pydantic import ValidationError

    from wicore.errors import ConfigError
    from wicore.grammars import grammar_problem
    from wicore.schemas import GuidedSpec

    try:
        spec = GuidedSpec(json_schema=json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(f"--guided-schema {path}: {str(exc).splitlines()[0]}") from None
    problem = grammar_problem(spec)
    if problem is not None:
        raise ConfigError(f"--guided-schema {path}: {problem}")
    return spec.model_dump(mode="json", exclude_none=True)


def run_guided_bench(bench: CaptionBench, guided: dict) -> dict:
    from wicore.models.gemma3 import make_seeded

    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = bench.model_dir or make_seeded(bench.workdir / bench.preset, bench.preset)
    paths = make_images(bench.workdir / "images", bench.warmup_images + bench.images, processes=os.cpu_count() or 4)
    warm, timed = paths[: bench.warmup_images], paths[bench.warmup_images :]
    free = run_product(bench, model_dir, warm, timed, bench.workdir / "worker-free.log")
    constrained = run_product(
        replace(bench, guided=guided), model_dir, warm, timed, bench.workdir / "worker-guided.log"
    )
    return {
        "gpu": device_name(bench.device),
        "preset": bench.preset,
        "engine_options": bench.engine_options,
        "new_tokens": bench.new_tokens,
        "guided": guided,
        "free": {key: free[key] for key in KEYS},
        "constrained": {key: constrained[key] for key in KEYS},
        "images_per_s_ratio": constrained["images_per_s"] / free["images_per_s"],
        "output_tokens_per_s_ratio": constrained["output_tokens_per_s"] / free["output_tokens_per_s"],
        "guided_host": guided_host(constrained["engine_stats"]),
        "constrained_engine_stats": constrained["engine_stats"],
    }


def guided_host(stats: dict) -> dict:
    """Host milliseconds per guided step (the engine's `guided_*` stats): waiting for the last
    tokens, then filling and applying the masks; with the step count."""
    steps = stats.get("guided_steps") or 0
    per_step = {key: 1e3 * stats.get(f"guided_{key}_s", 0.0) / steps if steps else None for key in ("wait", "mask")}
    return {"steps": steps, "wait_ms_per_step": per_step["wait"], "mask_ms_per_step": per_step["mask"]}


def write_guided_report(report: dict, folder: Path) -> list[Path]:
    """caption-<preset>-guided-<gpu>.json (caption-<preset>-guided-fp8-<gpu>.json with FP8 GEMMs)."""
    from wicore.bench.report import gpu_slug

    folder.mkdir(parents=True, exist_ok=True)
    dtype = "fp8-" if report["engine_options"].get("gemm_dtype") == "fp8" else ""
    path = folder / f"caption-{report['preset']}-guided-{dtype}{gpu_slug(report['gpu'])}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return [path]
