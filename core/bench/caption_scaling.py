"""`wicore bench caption --preset <preset> --gpus N`: the product path on N GPUs (`wicore worker
--gpus 0,...,N-1`: a worker process per GPU under the supervisor) and, in the same run, on one
(the plain `wicore worker`), each GPU given the same work: `images` timed images per GPU after a
warm-up. `scaling` is the ratio of the two images/s: N would be perfect."""

from __future__ import annotations

import os

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import CaptionBench, device_name, engine_option_words, run_product
from wicore.errors import ConfigError

RUN_KEYS = ("images", "seconds", "images_per_s", "output_tokens_per_s", "latency_p50_s", "latency_p99_s",
            "worker_start_s", "error_count", "errors")  # fmt: skip


def gpu_count_check(gpus: int, visible: int) -> None:
    """The benchmark takes GPUs 0..N-1: they must be here."""
    if gpus > visible:
        raise ConfigError(f"--gpus {gpus}: the benchmark needs {gpus} GPUs and {visible} are visible here")


def warmup_per_gpu(bench: CaptionBench) -> int:
    """Warm-up jobs per GPU: at least a full claim (a worker takes up to `batch_size` at once), so
    that every worker, not only the first to wake, has run before the clock starts."""
    return max(bench.warmup_images, bench.batch_size)


def scaling(images_per_s: float, images_per_s_1gpu: float, gpus: int) -> dict:
    """N GPUs against one: the speed-up and the share of a perfect N x that it is."""
    ratio = images_per_s / images_per_s_1gpu if images_per_s_1gpu > 0 else float("nan")
    return {"scaling": ratio, "scaling_efficiency": ratio / gpus}


def run_scaling_bench(bench: CaptionBench) -> dict:
    from wicore.models.gemma3 import make_seeded

    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = bench.model_dir or make_seeded(bench.workdir / bench.preset, bench.preset)
    warm, n = warmup_per_gpu(bench), bench.gpus
    paths = make_images(bench.workdir / "images", (warm + bench.images) * n, processes=os.cpu_count() or 4)
    plain_log, supervised_log = bench.workdir / "plain-worker.log", bench.workdir / f"supervised-x{n}.log"
    one = run_product(bench, model_dir, paths[:warm], paths[warm : warm + bench.images], plain_log)
    many = run_product(bench, model_dir, paths[: warm * n], paths[warm * n :], supervised_log, gpus=n)
    return scaling_report(bench, one, many, device_name(bench.device))


def scaling_report(bench: CaptionBench, one: dict, many: dict, gpu: str) -> dict:
    """The report of one scaling run from its two product runs (`run_product`'s dicts)."""
    n = bench.gpus
    return {
        "gpu": gpu,
        "preset": bench.preset,
        "command": scaling_command(bench),
        "gpus": n,
        "gemm_dtype": bench.engine_options.get("gemm_dtype", "model"),
        "images_per_s": many["images_per_s"],
        "images_per_s_1gpu": one["images_per_s"],
        **scaling(many["images_per_s"], one["images_per_s"], n),
        "engine": bench.engine,
        "engine_options": bench.engine_options,
        "batch_size": bench.batch_size,
        "images_per_gpu": bench.images,
        "warmup_images_per_gpu": warmup_per_gpu(bench),
        "new_tokens": bench.new_tokens,
        "run_1gpu": {key: one[key] for key in RUN_KEYS},  # the plain worker
        "run_ngpu": {key: many[key] for key in RUN_KEYS},
        "engine_stats_by_worker": many["engine_stats_by_worker"],
    }


def scaling_command(bench: CaptionBench) -> str:
    """The command line that runs this scaling benchmark again (`--dtype fp8` stands for the
    `gemm_dtype` option it sets)."""
    options = dict(bench.engine_options)
    words = [f"wicore bench caption --preset {bench.preset}", f"--gpus {bench.gpus}", f"--images {bench.images}"]
    words += ["--dtype fp8"] if options.pop("gemm_dtype", None) == "fp8" else []
    return " ".join(words + engine_option_words(options))
