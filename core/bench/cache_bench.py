"""`wicore bench cache`: what the tier caches buy, on the Gemma-3-4B shape (GPU machine).

- VQA: 256 images x 4 questions through the fast engine with caching off, with the GPU tiers
  only (vision-embedding cache + prefix KV blocks in the GPU pool), and with GPU + pinned CPU +
  disk tiers while the GPU pool is deliberately small. Key `vqa_speedup` (best tiered / off).
  Each config is timed `repeats` times on new images (runs of one config vary by ~5% on the
  H100) and reports its median run.
- Restore bandwidth: blocks restored from the CPU tier into GPU pages, against the pinned
  host-to-device bandwidth measured in the same run, per way of copying: one copy per run of
  slots into a staging buffer plus a scatter kernel (key `restore_bw_fraction`), and one batched
  copy straight into the pages (`restore_bw_fraction_batched`, None without cuda-python or a
  CUDA >= 12.8 driver). The VQA configs run with the engine's default (`batched_copies`).
- Bulk captioning with 30% duplicate images (distinct jobs: different seeds of a sampled
  decode would differ, so these are greedy repeats with distinct ids), cached vs off. Key
  `dup30_speedup`.
- The eviction-policy simulation (CPU). Key `policy_hit_rates`.

Each timed config also reports the device's busy share of each run (`gpu_busy_fraction_runs`,
NVML, core/bench/gpu_busy.py) and of its median run (`gpu_busy_fraction`): whether a config is
bound by device work or leaves the device idle.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import busy_sampler, device_name
from wicore.bench.gpu_busy import GpuBusySampler
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.options import FastOptions
from wicore.ops.image_decode import decode_image
from wicore.schemas import DEFAULT_PROMPT, GenerationParams

# Warm-up images, not in any timed run: a full vision batch (the compiled tower's shape: compiled
# on first use, ~3 s that an 8-image warm-up left inside the first timed run) and a partial one.
WARM_IMAGES = 40
QUESTIONS = (
    "Describe this image in detail.",
    "What are the main colours in this image?",
    "Is there any text in this image? If so, what does it say?",
    "What would be a good title for this picture?",
)


@dataclass
class CacheBench:
    workdir: Path
    images: int = 256
    questions: int = 4
    new_tokens: int = 32
    dup_images: int = 1024
    repeats: int = 3  # timed VQA runs per config, each on its own images; the median is reported
    # Sequences in flight. 1,024 (every request of a run) made decode batches larger but the
    # cached run no faster over three runs, and left the restore probe no memory (docs/benchmarks.md).
    batch_size: int = 384
    small_gpu_pages: int = 16_384  # the deliberately small GPU pool of the tiered run (~100 sequences)
    host_cache_bytes: int = 16 * 2**30
    disk_cache_bytes: int = 32 * 2**30
    device: str = "cuda"


def request(rid: str, path: Path, text: str, new_tokens: int) -> EngineRequest:
    return image_request(rid, path.read_bytes(), text, GenerationParams(max_new_tokens=new_tokens, ignore_eos=True))


def image_request(rid: str, data: bytes, text: str, params: GenerationParams, image=None) -> EngineRequest:
    """One question about one image (encoded file bytes; `image`: it decoded already, shared by
    the questions about it), hashed as a worker hashes it."""
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    image = decode_image(data) if image is None else image
    return EngineRequest(rid, chat, [image], params, [hashlib.sha256(data).hexdigest()])


def vqa_requests(paths: list[Path], questions: int, new_tokens: int, tag: str = "") -> list[EngineRequest]:
    """Question-major: every image gets its first question, then every image its second, ...:
    a follow-up comes after 255 other images, so a small GPU pool must have moved the image's
    prefix blocks down a tier and bring them back."""
    return [
        request(f"{tag}{i}-{q}", p, QUESTIONS[q], new_tokens) for q in range(questions) for i, p in enumerate(paths)
    ]


def dup_requests(paths: list[Path], count: int, new_tokens: int, share: float = 0.3) -> list[EngineRequest]:
    """`count` captions, `share` of them repeating an image seen earlier in the stream."""
    rng = random.Random(0)
    distinct = paths[: int(count * (1 - share))]
    picks = list(distinct) + [rng.choice(distinct) for _ in range(count - len(distinct))]
    rng.shuffle(picks)
    return [request(f"d{i}", p, DEFAULT_PROMPT, new_tokens) for i, p in enumerate(picks)]


def timed_generate(engine, requests: list[EngineRequest]) -> tuple[float, dict]:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(requests)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    errors = [c.error for c in out if not c.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return seconds, engine.stats()


def make_engine(model_dir: Path, bench: CacheBench, cache: bool, **options):
    from wicore.engines.fast import FastEngine

    config = EngineConfig(
        str(model_dir), device=bench.device, dtype="bfloat16", max_batch_size=bench.batch_size, cache=cache,
        options=FastOptions.parse(options),
    )  # fmt: skip
    return FastEngine(config)


def run_config(name: str, model_dir: Path, bench: CacheBench, request_sets, warm, cache: bool, **options) -> dict:
    """One engine, warmed up, timed on each request set in turn (sets share no image, so a
    cache starts cold on each); reports the median run. Counters cover all runs."""
    engine = make_engine(model_dir, bench, cache, **options)
    engine.generate(warm)  # compile, graphs and kernels warm; its images are not in `request_sets`
    samples, windows = [], []
    for requests in request_sets:
        began = time.time()
        seconds, stats = timed_generate(engine, requests)
        samples.append(round(seconds, 3))
        windows.append((began, began + seconds))
    release(engine)
    count, seconds = len(request_sets[0]), statistics.median(samples)
    print(f"{name}: {count / seconds:.1f} requests/s (median of {samples} s)", flush=True)
    keep = ("vision_s", "prefill_s", "decode_s", "images_encoded", "prompt_tokens", "cached_prompt_tokens",
            "vision_cache", "cache", "kv_blocks_demoted", "kv_blocks_dropped", "kv_restores_queued",
            "kv_pages", "kv_pages_free", "kv_pages_cached", "mean_decode_batch")  # fmt: skip
    return {"name": name, "seconds": seconds, "seconds_runs": samples, "requests_per_s": count / seconds,
            "windows": windows, **{k: stats[k] for k in keep if k in stats}}  # fmt: skip


def add_busy(run: dict, busy: GpuBusySampler) -> dict:
    """Replace a config's timed windows (time.time() pairs) with the device's busy share of each
    run and of its median run (None where NVML gave no sample)."""
    fractions = [busy.fraction(*window) for window in run.pop("windows")]
    median_run = sorted(range(len(fractions)), key=lambda i: run["seconds_runs"][i])[len(fractions) // 2]
    run["gpu_busy_fraction_runs"] = [None if f is None else round(f, 3) for f in fractions]
    run["gpu_busy_fraction"] = fractions[median_run]
    return run


def run_cache_bench(bench: CacheBench) -> dict:
    from wicore.bench.eviction_sim import simulate, standard_specs
    from wicore.bench.roofline import measure_ceilings
    from wicore.models.gemma3 import make_gemma3_4b

    bench.workdir.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(bench.device)
    model_dir = make_gemma3_4b(bench.workdir / "gemma3-4b")
    vqa_images = bench.images * bench.repeats
    paths = make_images(bench.workdir / "images", vqa_images + bench.dup_images + WARM_IMAGES, processes=16)
    warm = vqa_requests(paths[-WARM_IMAGES:], 1, 4)
    vqa = [
        vqa_requests(paths[r * bench.images : (r + 1) * bench.images], bench.questions, bench.new_tokens, f"r{r}-")
        for r in range(bench.repeats)
    ]
    disk = bench.workdir / "kv-disk"
    shutil.rmtree(disk, ignore_errors=True)
    split = {"prefix_split_images": True}  # a follow-up shares the image's blocks, not just the ones before it
    with busy_sampler(bench.device) as busy:
        runs = [
            run_config("off", model_dir, bench, vqa, warm, cache=False),
            run_config("gpu", model_dir, bench, vqa, warm, cache=True, host_cache_bytes=0, **split),
            run_config("gpu+cpu+disk (small GPU pool)", model_dir, bench, vqa, warm, cache=True,
                       num_kv_blocks=bench.small_gpu_pages, host_cache_bytes=bench.host_cache_bytes,
                       disk_cache_dir=str(disk), disk_cache_bytes=bench.disk_cache_bytes, **split),
        ]  # fmt: skip
        restore = measure_restore_bandwidths(model_dir, bench)
        dups = [dup_requests(paths[vqa_images : vqa_images + bench.dup_images], bench.dup_images, 64)]
        dup_off = run_config("dup30 off", model_dir, bench, dups, warm, cache=False)
        dup_on = run_config("dup30 cached", model_dir, bench, dups, warm, cache=True)
    for run in (*runs, dup_off, dup_on):
        add_busy(run, busy)
    print("GPU busy (median runs): " + ", ".join(f"{r['name']} {_share(r['gpu_busy_fraction'])}" for r in runs))
    off = runs[0]["requests_per_s"]
    return {
        "gpu": device_name(bench.device),
        "command": "wicore bench cache",
        "ceilings": ceilings.as_dict(),
        "gpu_busy_error": busy.error,
        "vqa": runs,
        "vqa_speedup": max(r["requests_per_s"] for r in runs[1:]) / off,
        "vqa_speedup_by_config": {r["name"]: r["requests_per_s"] / off for r in runs},
        "restore_bytes_per_s": restore["per_run"],
        "restore_bytes_per_s_batched": restore["batched"],
        "h2d_bytes_per_s": ceilings.h2d_bytes_per_s,
        "restore_bw_fraction": restore["per_run"] / ceilings.h2d_bytes_per_s,
        "restore_bw_fraction_batched": _fraction(restore["batched"], ceilings.h2d_bytes_per_s),
        "dup30": [dup_off, dup_on],
        "dup30_speedup": dup_on["requests_per_s"] / dup_off["requests_per_s"],
        **policy_results(simulate(standard_specs())),
    }


def _share(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.3f}"


def policy_results(results) -> dict:
    return {
        "policy_hit_rates": results.policy_hit_rates(),
        "policy_cost_weighted_hit_rates": results.policy_hit_rates(weighted=True),
        "_simulation": results,  # for the plot; not written to JSON
    }


def measure_restore_bandwidths(model_dir: Path, bench: CacheBench) -> dict[str, float | None]:
    from wicore.bench.restore_probe import restore_bandwidths

    engine = make_engine(model_dir, bench, True, host_cache_bytes=0)  # the probe brings its own host tier
    try:
        return restore_bandwidths(engine, 2048)
    finally:
        release(engine)


def _fraction(value: float | None, ceiling: float) -> float | None:
    return None if value is None else value / ceiling


def release(engine) -> None:
    """Close an engine and collect it (its parts reference each other), so the next
    configuration gets the device memory."""
    import gc

    import torch

    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
