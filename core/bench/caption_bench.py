"""`wicore bench caption --preset gemma3-4b|gemma3-12b|gemma3-27b`: bulk captioning through the
whole product (embedded Redis, producer, scheduler, worker, engine) against HF `generate` on the
same model, images and token counts, in the same run (HF after the worker has exited, at each
of its batch sizes that fits); with the roofline from the config, the ceilings measured at the
start of the run and the worker's time to ready. `--variant` sends two images a prompt, or text
only (`caption_variants`), to both sides."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wicore.bench.bench_images import make_images
from wicore.bench.caption_variants import BenchPrompt, bench_prompts, images_per_prompt, peer_chat, submission
from wicore.bench.gpu_busy import GpuBusySampler
from wicore.bench.roofline import Ceilings, image_work, measure_ceilings, roofline_images_per_s
from wicore.schemas import DEFAULT_PROMPT

START_JOBS = 32  # the first jobs submitted, whose timings show how the pipeline fills (`start_timeline`)
START_WINDOW_S = 2.0  # the timed window's first seconds, apart in the sampled loop thread's report
DIP_BUSY = 0.95  # a later second whose GPU busy share is below this gets its own sampled table
DIP_ROWS = 8  # rows of each such table


@dataclass
class CaptionBench:
    workdir: Path
    preset: str = "gemma3-4b"  # the seeded model's shape (`wicore.models.gemma3.SEEDED_PRESETS`); its model id too
    images: int = 1024
    new_tokens: int = 64
    batch_size: int = 384  # the engine's running sequences and the scheduler's claim size
    engine: str = "fast"
    engine_options: dict = field(default_factory=dict)
    hf_batches: tuple[int, ...] = (8, 32, 64)
    hf_images: int = 128  # per batched peer run
    # Timed passes of each batched peer; its fastest counts. A batch size's first pass pays its
    # first-call costs (the warm-up runs batch 2), and HF generate is host-bound (its processor
    # and per-step Python run on the CPU), so one pass can read tens of percent slow
    # (docs/benchmarks.md has the passes measured).
    hf_repeats: int = 3
    hf_single_images: int = 6  # the batch-1 peer
    warmup_images: int = 64
    prompt: str = DEFAULT_PROMPT
    device: str = "cuda"
    gpus: int = 0  # 0: the plain worker; N: also a worker process per GPU on N GPUs (caption_scaling.py)
    model_dir: Path | None = None  # default: `make-model <preset>` (seeded weights on the device)
    hf_peers: bool = True  # False (`--no-hf`): the product alone, for A/B runs of engine options
    decode_processes: int | None = None  # the worker's `--decode-processes`; None: its default
    sample_stacks: bool = False  # the worker's loop thread sampled (`stack_sampler`): `host_stacks` in the JSON
    variant: str = "one-image"  # what a prompt holds (`caption_variants.VARIANTS`)
    sampling: dict = field(default_factory=dict)  # GenerationParams fields on every job (penalties, logprobs, n)
    guided: dict | None = None  # a `guided` spec on every job (caption_guided.py); those end with their grammar


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def busy_sampler(device: str) -> GpuBusySampler:
    """NVML samples of the GPU the worker runs on (`--device cuda[:N]`); none on CPU."""
    return GpuBusySampler(int(device.partition(":")[2] or 0) if device.startswith("cuda") else None)


def wait_for_workers(connection, process, log: Path, count: int, timeout: float = 900) -> list[str]:
    """The names of the `count` workers once all have registered (their models loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        names = sorted(n.decode().split(":")[-1] for n in connection.smembers("rq:workers"))
        if len(names) >= count:
            return names
        time.sleep(0.5)
    raise RuntimeError(f"{count} workers did not start in time")


def worker_command(bench: CaptionBench, url: str, model_dir: Path, root: Path, gpus: int) -> list[str]:
    """`wicore worker` as the benchmark runs it: plain (gpus=0), or one worker process per GPU
    under the supervisor (`--gpus 0,...,N-1`; on CPU, `--workers N`)."""
    args = ["--redis-url", url, "--model", str(model_dir), "--model-id", bench.preset, "--engine", bench.engine,
            "--device", bench.device, "--batch-size", str(bench.batch_size), "--allow-root", str(root),
            "--max-queue-delay-ms", "20", "--allow-random-weights"]  # fmt: skip
    for key, value in bench.engine_options.items():
        args += ["--engine-option", f"{key}={json.dumps(value)}"]
    if bench.decode_processes is not None:
        args += ["--decode-processes", str(bench.decode_processes)]
    if gpus and bench.device.startswith("cuda"):
        args += ["--gpus", ",".join(str(i) for i in range(gpus))]
    elif gpus:
        args += ["--workers", str(gpus)]
    return [sys.executable, "-m", "wicore.cli.main", "worker", *args]


def run_product(
    bench: CaptionBench, model_dir: Path, warm: list[Path], timed: list[Path], log: Path, gpus: int = 0
) -> dict:
    """Warm up on `warm`, then time `timed` end to end, on the plain worker (gpus=0) or on a
    worker process per GPU (gpus=N)."""
    from redis import Redis

    from wicore.embedded import EmbeddedRedis
    from wicore.producer import Producer, ProducerConfig
    from wicore.schemas import GenerationParams
    from wicore.worker.status import published_stats

    params = GenerationParams(max_new_tokens=bench.new_tokens, ignore_eos=True, **bench.sampling)
    if bench.guided is not None:
        params = GenerationParams(max_new_tokens=bench.new_tokens, guided=bench.guided, **bench.sampling)
    with EmbeddedRedis() as server, busy_sampler(bench.device) as busy:
        command = worker_command(bench, server.url, model_dir, timed[0].parent, gpus)
        stacks = log.with_name("worker-stacks.json")
        with open(log, "wb") as sink:
            worker = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=worker_env(bench, stacks))
        try:
            connection = Redis.from_url(server.url)
            started = time.perf_counter()
            names = wait_for_workers(connection, worker, log, max(1, gpus))
            load_s = time.perf_counter() - started
            producer = Producer(server.url, model=bench.preset, config=ProducerConfig(by_path=True))
            warm_ids = producer.submit_many(submission(p, params) for p in prompts_of(bench, warm, "warm-"))
            list(producer.wait(warm_ids, timeout=900))
            start, start_wall = time.perf_counter(), time.time()
            prompts = prompts_of(bench, timed)
            ids = producer.submit_many(submission(p, params) for p in prompts)
            outcomes = {o.job_id: o for o in producer.wait(ids, timeout=1800)}
            seconds = time.perf_counter() - start
            busy_window = (start_wall, start_wall + seconds)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=120)
        stats = {name: published_stats(connection, name) for name in names}  # at stop
    errors = [o.error for o in outcomes.values() if o.error]
    results = [o.result for o in outcomes.values() if o.result]
    tokens = {p.key: list(outcomes[i].result.token_ids) for p, i in zip(prompts, ids) if outcomes[i].result}
    latencies = [r.timings.total_s for r in results]
    return {
        "images": len(timed),
        "prompts": len(prompts),
        "seconds": seconds,
        "prompts_per_s": len(results) / seconds,
        "images_per_s": len(results) * images_per_prompt(bench.variant) / seconds,
        "output_tokens_per_s": sum(r.output_tokens for r in results) / seconds,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "errors": errors[:5],
        "error_count": len(errors),
        "worker_start_s": load_s,
        "gpu_busy_fraction": busy.fraction(*busy_window),
        "gpu_busy_error": busy.error,
        "gpu_busy_by_second": [None if f is None else round(f, 3) for f in busy.profile(*busy_window)],
        "engine_stats": stats[names[0]],
        "engine_stats_by_worker": stats,
        "tokens": tokens,
        "host_stacks": host_stacks(stacks, start_wall, busy.profile(*busy_window)),
        "start_timeline": start_timeline([outcomes[i].result for i in ids[:START_JOBS]]),
    }


def prompts_of(bench: CaptionBench, paths: list[Path], prefix: str = "") -> list[BenchPrompt]:
    """The variant's prompts of `paths`; `prefix` keeps the warm-up's text prompts apart from
    the timed ones (the same text would be the same job)."""
    prompts = bench_prompts(bench.variant, paths, bench.prompt)
    return [BenchPrompt(prefix + p.key, p.images, prefix + p.text) if not p.images else p for p in prompts]


def host_stacks(path: Path, start_wall: float, busy_by_second: list[float | None]) -> dict | None:
    """The loop thread's report (`--sample-stacks`), with, in place of its raw recent samples,
    the first `START_WINDOW_S` of the timed window apart (`start`: while the pipeline fills) and
    each later second the GPU idled in (`dips`: busy below `DIP_BUSY`, the second's offset)."""
    from wicore.stack_sampler import innermost_between

    if not path.exists():
        return None
    report = json.loads(path.read_text())
    report["start"] = innermost_between(report, start_wall, start_wall + START_WINDOW_S)
    report["dips"] = []
    for second, busy in enumerate(busy_by_second):
        if second >= START_WINDOW_S and busy is not None and busy < DIP_BUSY:
            table = innermost_between(report, start_wall + second, start_wall + second + 1)
            report["dips"].append({"second": second, "busy": busy, "samples": table["samples"],
                                   "innermost": table["innermost"][:DIP_ROWS]})  # fmt: skip
    report.pop("recent", None)
    return report


def start_timeline(results: list) -> dict:
    """How the pipeline fills: for the jobs submitted first, submitted -> taken by the worker,
    their image load, submitted -> in the engine (with the result's write), and submitted ->
    first token, each as [min, median, max] seconds."""
    timings = [r.timings for r in results if r is not None]

    def spread(values: list[float | None]) -> list[float] | None:
        known = sorted(v for v in values if v is not None)
        return [round(known[0], 3), round(percentile(known, 50), 3), round(known[-1], 3)] if known else None

    return {
        "jobs": len(timings),
        "queued_s": spread([t.queued_s for t in timings]),
        "preprocess_s": spread([t.preprocess_s for t in timings]),
        "to_engine_s": spread([t.total_s - t.engine_s for t in timings]),
        "first_token_s": spread([t.first_token_s for t in timings]),
    }


def worker_env(bench: CaptionBench, stacks: Path) -> dict[str, str]:
    """The worker's environment: INFO logs, and with `sample_stacks` its loop thread's report
    written to `stacks` (a previous run's removed first)."""
    stacks.unlink(missing_ok=True)
    env = {**os.environ, "WICORE_LOG_LEVEL": "INFO"}
    if bench.sample_stacks:
        env["WICORE_SAMPLE_STACKS"] = str(stacks)
    return env


def run_peers(bench: CaptionBench, model_dir: Path, paths: list[Path]) -> dict:
    """HF `generate` at batch 1 and at each static batch size, on the timed images."""
    import torch

    from wicore.bench.hf_peer import run_generate
    from wicore.engines.checkpoint import load_hf_model, load_processor
    from wicore.engines.text import stop_token_ids

    processor = load_processor(model_dir)
    processor.tokenizer.padding_side = "left"  # generate continues every row from its last column
    cuda = bench.device.startswith("cuda")
    model = load_hf_model(model_dir, bench.device, "bfloat16" if cuda else "float32")
    eos = sorted(stop_token_ids(model_dir, processor.tokenizer))
    timed = paths[bench.warmup_images :]
    prompts = peer_prompts(bench, timed[: max(bench.hf_images, bench.hf_single_images)])
    single, batched = prompts[: bench.hf_single_images], prompts[: bench.hf_images]
    run_generate(model, processor, prompts[:2], 4, 2, eos)  # warm-up (cuBLAS, kernels)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runs = {1: run_generate(model, processor, single, bench.new_tokens, 1, eos)}
    passes: dict[str, list[float] | str] = {}
    for batch in bench.hf_batches:
        try:
            timed_runs = [
                run_generate(model, processor, batched, bench.new_tokens, batch, eos) for _ in range(bench.hf_repeats)
            ]
        except torch.OutOfMemoryError:  # a larger model leaves room for smaller batches only
            passes[str(batch)] = "out of memory"
            torch.cuda.empty_cache()
            continue
        passes[str(batch)] = [r.images_per_s for r in timed_runs]
        runs[batch] = max(timed_runs, key=lambda r: r.prompts_per_s)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    best = max(runs, key=lambda b: runs[b].prompts_per_s)  # batch 1 when no larger batch fits
    keys = [p.key for p in prompts_of(bench, timed)]
    tokens = {b: dict(zip(keys, r.tokens)) for b, r in runs.items()}
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {
        "images_per_s": {str(b): r.images_per_s for b, r in runs.items()},
        "passes": passes,
        "best_batch": best,
        "best_images_per_s": runs[best].images_per_s,
        "batch1_images_per_s": runs[1].images_per_s,
        "prompts_per_s": {str(b): r.prompts_per_s for b, r in runs.items()},
        "best_prompts_per_s": runs[best].prompts_per_s,
        "batch1_prompts_per_s": runs[1].prompts_per_s,
        "best_output_tokens_per_s": runs[best].output_tokens_per_s,
        "peak_gpu_bytes": peak,
        "tokens_by_batch": tokens,
        "best_margins": dict(zip(keys, runs[best].margins)),
    }


def peer_prompts(bench: CaptionBench, paths: list[Path]) -> list:
    """The variant's prompts of `paths` as the HF peer takes them (images decoded)."""
    from wicore.bench.hf_peer import PeerPrompt
    from wicore.ops.image_decode import decode_image

    return [
        PeerPrompt(peer_chat(p), [decode_image(path.read_bytes()) for path in p.images])
        for p in prompts_of(bench, paths)
    ]


def parity(
    ours: dict[str, list[int]], theirs: dict[str, list[int]], margins: dict[str, list[float]] | None = None
) -> dict:
    """Share of sequences whose tokens are identical, and where the others first differ. With
    `theirs`' per-step logit margins (top-1 - top-2): the margin where each differing sequence
    turned, beside the median margin of all compared steps, so a turn on a near tie (rounding)
    reads apart from one on a clear lead (a bug)."""
    common = [k for k in theirs if k in ours]
    same = [k for k in common if ours[k] == theirs[k]]
    turns = {k: next(i for i, (a, b) in enumerate(zip(ours[k], theirs[k])) if a != b) for k in common
             if k not in same and len(ours[k]) == len(theirs[k])}  # fmt: skip
    report = {"compared": len(common), "identical": len(same), "share": len(same) / max(1, len(common)),
              "first_divergence_steps": sorted(turns.values())}  # fmt: skip
    if margins is not None:
        report["margins_at_divergence"] = sorted(round(margins[k][i], 4) for k, i in turns.items() if k in margins)
        steps = [m for k in common if k in margins for m in margins[k]]
        report["median_margin"] = round(percentile(steps, 50), 4) if steps else None
    return report


@dataclass
class CaptionRuns:
    """What a caption report is made of: the product's run and HF's on one model and image set."""

    model_dir: Path
    warm: list[Path]
    timed: list[Path]
    ceilings: Ceilings
    product: dict
    peers: dict | None  # None: run without the HF peer (--no-hf)


def run_caption_bench(bench: CaptionBench, ceilings: Ceilings | None = None) -> dict:
    return caption_report(bench, caption_runs(bench, ceilings))


def caption_runs(bench: CaptionBench, ceilings: Ceilings | None = None) -> CaptionRuns:
    from wicore.models.gemma3 import make_seeded

    bench.workdir.mkdir(parents=True, exist_ok=True)
    ceilings = ceilings or measure_ceilings(bench.device)
    model_dir = bench.model_dir or make_seeded(bench.workdir / bench.preset, bench.preset)
    paths = make_images(bench.workdir / "images", bench.warmup_images + bench.images, processes=os.cpu_count() or 4)
    warm, timed = paths[: bench.warmup_images], paths[bench.warmup_images :]
    product = run_product(bench, model_dir, warm, timed, bench.workdir / "worker.log")
    peers = run_peers(bench, model_dir, paths) if bench.hf_peers else None
    return CaptionRuns(model_dir, warm, timed, ceilings, product, peers)


def caption_report(bench: CaptionBench, runs: CaptionRuns) -> dict:
    """The report's keys (the JSON) from the runs; the roofline is the model dtype's (bf16)."""
    from transformers import AutoConfig

    product, peers, ceilings = runs.product, runs.peers, runs.ceilings
    config = AutoConfig.from_pretrained(runs.model_dir)
    prompt_tokens = product["engine_stats"].get("mean_prompt_tokens") or 281  # 281: the 4B prompt here
    work = image_work(config, prompt_tokens, bench.new_tokens)
    roofline, bound = roofline_images_per_s(work, ceilings, bench.batch_size, prompt_tokens, bench.new_tokens)
    if bench.variant != "one-image":
        roofline, bound = None, "one image a prompt only"  # the roofline counts one image's work a prompt
    return {
        "gpu": device_name(bench.device),
        "preset": bench.preset,
        "variant": bench.variant,
        "images_per_prompt": images_per_prompt(bench.variant),
        "prompts_per_s": product["prompts_per_s"],
        "command": bench_command(bench),
        "engine": bench.engine,
        "engine_options": bench.engine_options,
        "decode_processes": bench.decode_processes,  # None: the worker's default
        "batch_size": bench.batch_size,
        "images": bench.images,
        "new_tokens": bench.new_tokens,
        "ceilings": ceilings.as_dict(),
        "flops_per_image_t": round(work.flops / 1e12, 3),
        "roofline_images_per_s": roofline,
        "roofline_bound": bound,
        "images_per_s": product["images_per_s"],
        "roofline_fraction": None if roofline is None else product["images_per_s"] / roofline,
        "gpu_busy_fraction": product["gpu_busy_fraction"],  # NVML: a kernel ran (core/bench/gpu_busy.py)
        "gpu_busy_error": product["gpu_busy_error"],
        "gpu_busy_by_second": product["gpu_busy_by_second"],  # where in the window it idled
        **peer_report(product, peers),
        "output_tokens_per_s": product["output_tokens_per_s"],
        "latency_p50_s": product["latency_p50_s"],
        "latency_p99_s": product["latency_p99_s"],
        "peak_gpu_bytes": product["engine_stats"].get("peak_gpu_bytes"),
        "worker_start_s": product["worker_start_s"],
        **startup_report(product["engine_stats"]),
        "errors": product["errors"],
        "error_count": product["error_count"],
        "engine_stats": product["engine_stats"],
        "host_stacks": product["host_stacks"],  # None without --sample-stacks
        "start_timeline": product["start_timeline"],  # the first jobs' way through the pipeline
    }


def bench_command(bench: CaptionBench, dtype: str | None = None) -> str:
    """The command line that runs this benchmark again."""
    words = [f"wicore bench caption --preset {bench.preset}", f"--images {bench.images}"]
    words += [f"--dtype {dtype}"] if dtype else []
    words += [] if bench.variant == "one-image" else [f"--variant {bench.variant}"]
    if bench.hf_peers:
        words += [f"--hf-batches {','.join(str(b) for b in bench.hf_batches)}", f"--hf-images {bench.hf_images}"]
        words += [f"--hf-repeats {bench.hf_repeats}"]
    else:
        words.append("--no-hf")
    words += [] if bench.decode_processes is None else [f"--decode-processes {bench.decode_processes}"]
    words += ["--sample-stacks"] if bench.sample_stacks else []
    return " ".join(words + engine_option_words(bench.engine_options))


def sampling_words(sampling: dict) -> list[str]:
    """`--sampling` as the command line gives it (shell-quoted JSON)."""
    return [f"--sampling '{json.dumps(sampling, sort_keys=True)}'"] if sampling else []


def startup_report(stats: dict) -> dict:
    """The worker's time to ready by phase (the engine's stats), the load's peak device memory
    and the KV pages that fit beside the model."""
    phases = ("load_s", "compile_s", "kv_warm_up_s", "graph_capture_s")
    return {
        "time_to_ready_s": stats.get("ready_s"),
        "ready_phases_s": {phase: stats.get(phase) for phase in phases},
        "load_peak_bytes": stats.get("load_peak_bytes"),
        "weight_bytes": stats.get("weight_bytes"),
        "kv_pages": stats.get("kv_pages"),
    }


def engine_option_words(options: dict) -> list[str]:
    """`--engine-option KEY=VALUE` for each option, as a benchmark's command line gives them."""
    return [f"--engine-option {key}={value}" for key, value in options.items()]


def peer_report(product: dict, peers: dict | None) -> dict:
    """The HF peer's keys of the report: speeds, ratios, token parity; None each without the
    peer (`--no-hf`)."""
    if peers is None:
        keys = ("hf_best_images_per_s", "hf_best_batch", "hf_batch1_images_per_s", "hf_images_per_s",
                "hf_images_per_s_passes", "speedup_vs_hf_best", "speedup_vs_hf_batch1", "hf_peak_gpu_bytes",
                "parity_vs_hf_best_batch", "parity_vs_hf_batch1", "hf_batch1_vs_hf_best_batch",
                "hf_batches_vs_hf_best_batch", "hf_prompts_per_s", "hf_best_prompts_per_s",
                "hf_best_output_tokens_per_s")  # fmt: skip
        return dict.fromkeys(keys)
    tokens = peers["tokens_by_batch"]
    best = tokens[peers["best_batch"]]
    # HF against itself: how often its own batch sizes (other cuBLAS tilings) agree
    hf_vs_best = {str(b): parity(t, best, peers["best_margins"]) for b, t in tokens.items() if b != peers["best_batch"]}
    return {
        "hf_best_images_per_s": peers["best_images_per_s"],
        "hf_best_batch": peers["best_batch"],
        "hf_batch1_images_per_s": peers["batch1_images_per_s"],
        "hf_images_per_s": peers["images_per_s"],
        "hf_images_per_s_passes": peers["passes"],
        "hf_prompts_per_s": peers["prompts_per_s"],
        "hf_best_prompts_per_s": peers["best_prompts_per_s"],
        "hf_best_output_tokens_per_s": peers["best_output_tokens_per_s"],
        # prompts/s ratios: the images/s ratios where prompts hold images, defined for text only too
        "speedup_vs_hf_best": product["prompts_per_s"] / peers["best_prompts_per_s"],
        "speedup_vs_hf_batch1": product["prompts_per_s"] / peers["batch1_prompts_per_s"],
        "hf_peak_gpu_bytes": peers["peak_gpu_bytes"],
        "parity_vs_hf_best_batch": parity(product["tokens"], best, peers["best_margins"]),
        "parity_vs_hf_batch1": parity(product["tokens"], tokens[1]),
        "hf_batch1_vs_hf_best_batch": hf_vs_best.get("1"),  # None: batch 1 is HF's best (no larger batch fit)
        "hf_batches_vs_hf_best_batch": hf_vs_best,
    }
