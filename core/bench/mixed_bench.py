"""`wicore bench mixed`: interactive jobs beside bulk work, on one worker, in one run.

1. Idle: `interactive` high-lane jobs arrive at `rate` per second on an otherwise idle worker.
2. Mixed: `bulk_images` normal-lane jobs are queued at once (more than the worker gets through in
   the phase, so its running set stays full), and `lead_s` after the first of them ends (the
   pipeline full, however long the first batch took) the interactive jobs arrive again
   at the same rate: the same image bytes plus one trailing byte (the same pixels and decode work,
   a new hash, so no cache serves them). Bulk jobs left when the last interactive job ends are
   canceled.

A job's latency is its producer's view: from the submit call to its result. Reported: the
interactive p50 / p99 of both phases and the p99 ratio (target <= 2), bulk images/s before the
interactive jobs start and while they run, and whether bulk jobs were queued throughout
(`saturated`). The worker and the model are made as `wicore bench caption` makes them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import CaptionBench, device_name, percentile, wait_for_workers, worker_command
from wicore.schemas import DEFAULT_PROMPT, GenerationParams, Lane

INTERACTIVE_WARMUP = 4  # interactive jobs run alone before the idle phase (small-batch paths)

MODEL_ID = "gemma3-4b"  # the model id the bench worker serves (`worker_command` names it by the preset)


@dataclass(frozen=True)
class MixedBench:
    workdir: Path
    preset: str = "gemma3-4b"
    bulk_images: int = 6144  # more than the worker gets through: the rest are canceled
    interactive: int = 120  # per phase; p99 then lies between the 2nd and 3rd slowest (with 60: the 2 slowest)
    rate: float = 1.0  # interactive jobs per second, both phases
    lead_s: float = 10.0  # bulk alone, from its first result, before the mixed phase's interactive jobs
    new_tokens: int = 64  # every interactive job, and bulk jobs unless bulk_new_tokens
    bulk_new_tokens: int | None = None
    batch_size: int = 384  # the engine's running sequences (wicore worker --batch-size)
    high_lane_slots: int | None = None  # None: the worker's default
    engine: str = "fast"
    engine_options: dict = field(default_factory=dict)
    warmup_images: int = 64  # bulk jobs before the clock starts (compiles, full vision batches)
    device: str = "cuda"
    prompt: str = DEFAULT_PROMPT
    model_dir: Path | None = None  # default: made for the preset in `workdir`

    @property
    def command(self) -> str:
        return (
            f"wicore bench mixed --preset {self.preset} --bulk-images {self.bulk_images} "
            f"--interactive {self.interactive} --rate {self.rate:g}"
        )


# The tiny preset tests the mechanism on CPU (the numbers are not the GPU's). Its bulk jobs run
# 256 tokens, so that, as on the GPU, a bulk job stays in the engine many times longer than an
# interactive one; one torch thread, as two OpenMP threads on a busy 2-core machine slow each step.
PRESETS = {
    "gemma3-4b": {},
    "tiny": {"device": "cpu", "batch_size": 16, "bulk_images": 400, "interactive": 20, "rate": 2.0,
             "lead_s": 3.0, "new_tokens": 32, "bulk_new_tokens": 256, "warmup_images": 16,
             "engine_options": {"torch_threads": 1}},
}  # fmt: skip


def preset_bench(preset: str, workdir: Path, **overrides) -> MixedBench:
    """The preset's bench with the given overrides (None: the preset's value; engine options
    go on top of the preset's)."""
    from wicore.errors import ConfigError

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    bench = MixedBench(workdir=workdir, preset=preset, **PRESETS[preset])
    known = {f.name for f in fields(MixedBench)}
    given = {k: v for k, v in overrides.items() if v is not None and k in known}
    if "engine_options" in given:
        given["engine_options"] = {**bench.engine_options, **given["engine_options"]}
    return replace(bench, **given)


@dataclass
class Timed:
    """One job as the benchmark saw it."""

    latency_s: float
    ok: bool
    timings: dict  # the worker's split of it (queued_s, preprocess_s, engine_s, total_s); {} on error
    error: str | None = None


def run_mixed_bench(bench: MixedBench) -> dict:
    from wicore.embedded import EmbeddedRedis

    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = bench.model_dir or make_model(bench)
    warm, bulk_warm, idle_paths, bulk = bench_images(bench)
    twins = twin_images(idle_paths)
    with EmbeddedRedis() as server, started_worker(bench, server.url, model_dir, idle_paths[0].parent) as worker:
        run = BenchRun(bench, server.url)
        run.warm_up(bulk_warm, warm)
        idle = run.interactive(idle_paths)
        mixed, bulk_report = run.mixed(bulk, twins)
        worker.stop()
        stats = worker.stats()
    return mixed_report(bench, idle, mixed, bulk_report, worker.start_s, stats)


def make_model(bench: MixedBench) -> Path:
    """The preset's checkpoint, made as `wicore make-model` makes it."""
    from wicore.models.gemma3 import make_gemma3_4b, make_tiny

    if bench.preset == "tiny":
        return make_tiny(bench.workdir / "tiny")
    return make_gemma3_4b(bench.workdir / "gemma3-4b")


def bench_images(bench: MixedBench) -> tuple[list[Path], list[Path], list[Path], list[Path]]:
    """(interactive warm-up, bulk warm-up, interactive, bulk) image files, all distinct."""
    counts = (INTERACTIVE_WARMUP, bench.warmup_images, bench.interactive, bench.bulk_images)
    paths = make_images(bench.workdir / "images", sum(counts), processes=os.cpu_count() or 4)
    parts, start = [], 0
    for count in counts:
        parts.append(paths[start : start + count])
        start += count
    return parts[0], parts[1], parts[2], parts[3]


def twin_images(paths: list[Path]) -> list[Path]:
    """A copy of each file with one byte appended: JPEG and PNG decoders stop at their end
    marker, so the pixels are the same, and the hash (the caches' key, the job id) is new."""
    twins = []
    for path in paths:
        twin = path.with_name(f"twin-{path.name}")
        twin.write_bytes(path.read_bytes() + b"\0")
        twins.append(twin)
    return twins


class BenchWorker:
    """The `wicore worker` process under test."""

    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        from redis import Redis

        self.process, self.connection = process, Redis.from_url(url)
        started = time.perf_counter()
        self.names = wait_for_workers(self.connection, process, log, 1)
        self.start_s = time.perf_counter() - started

    def stop(self) -> None:
        stop_process(self.process)

    def stats(self) -> dict:
        """What the worker published at its stop (engine counters among them)."""
        from wicore.worker.status import published_stats

        return published_stats(self.connection, self.names[0])


@contextmanager
def started_worker(bench: MixedBench, url: str, model_dir: Path, root: Path) -> Iterator[BenchWorker]:
    """`wicore worker` as `wicore bench caption` starts it, with the high lane's slots."""
    plain = CaptionBench(workdir=bench.workdir, batch_size=bench.batch_size, engine=bench.engine,
                         engine_options=bench.engine_options, device=bench.device, preset=MODEL_ID)  # fmt: skip
    command = worker_command(plain, url, model_dir, root, 0)
    if bench.high_lane_slots is not None:
        command += ["--high-lane-slots", str(bench.high_lane_slots)]
    log = bench.workdir / "worker.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "WICORE_LOG_LEVEL": "INFO"})  # fmt: skip
    try:
        yield BenchWorker(process, url, log)
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM (a warm stop: the worker publishes its stats), then wait for it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)


class BenchRun:
    """The producers' side: warm-up, the interactive arrivals, the bulk run beside them."""

    def __init__(self, bench: MixedBench, url: str):
        from wicore.producer import Producer, ProducerConfig

        self.bench = bench
        self.params = GenerationParams(max_new_tokens=bench.new_tokens, ignore_eos=True)
        self.bulk_params = GenerationParams(max_new_tokens=bench.bulk_new_tokens or bench.new_tokens, ignore_eos=True)
        config = ProducerConfig(by_path=True)
        self.interactive_producer = Producer(url, model=MODEL_ID, config=config)
        self.bulk_producer = Producer(url, model=MODEL_ID, config=config)

    def submission(self, path: Path, lane: Lane):
        from wicore.producer import Submission

        params = self.params if lane is Lane.HIGH else self.bulk_params
        return Submission(path, self.bench.prompt, params=params, priority=lane)

    def warm_up(self, bulk: list[Path], interactive: list[Path]) -> None:
        """Bulk jobs together (full batches, compiles), then interactive jobs one at a time."""
        ids = self.bulk_producer.submit_many(self.submission(p, Lane.NORMAL) for p in bulk)
        list(self.bulk_producer.wait(ids, timeout=1800))
        for path in interactive:
            [job_id] = self.interactive_producer.submit_many([self.submission(path, Lane.HIGH)])
            self.interactive_producer.outcome(job_id, timeout=600)

    def interactive(self, paths: list[Path], on_submit: Callable[[], None] | None = None) -> list[Timed]:
        """One high-lane job every 1/rate seconds; each timed from its submit call to its result."""
        producer, start = self.interactive_producer, time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, len(paths)), thread_name_prefix="bench-waiter") as waiters:
            futures = []
            for i, path in enumerate(paths):
                time.sleep(max(0.0, start + i / self.bench.rate - time.perf_counter()))
                if on_submit is not None:
                    on_submit()
                submitted = time.perf_counter()
                [job_id] = producer.submit_many([self.submission(path, Lane.HIGH)])
                futures.append(waiters.submit(await_job, producer, job_id, submitted))
            return [future.result() for future in futures]

    def mixed(self, bulk: list[Path], interactive: list[Path]) -> tuple[list[Timed], dict]:
        """The bulk run, and the interactive jobs beside it once it has run `lead_s` alone past
        its first result."""
        producer = self.bulk_producer
        submissions = [self.submission(p, Lane.NORMAL) for p in bulk]
        queue = f"rq:queue:{producer.rules.bucket(producer.prepare(submissions[0]).job).queue_name}"
        ids = producer.submit_many(submissions)
        tally = BulkTally(producer, ids)
        tally.first_ended.wait(timeout=1800)
        time.sleep(self.bench.lead_s)
        queued: list[int] = []
        window = [time.perf_counter()]
        timed = self.interactive(interactive, on_submit=lambda: queued.append(producer.connection.llen(queue)))
        window.append(time.perf_counter())
        queued.append(producer.connection.llen(queue))
        producer.cancel(ids)
        tally.join()
        return timed, tally.report(window[0], window[1], queued)


def await_job(producer, job_id: str, submitted: float) -> Timed:
    outcome = producer.outcome(job_id, timeout=1800)
    latency = time.perf_counter() - submitted
    if outcome.result is None:
        return Timed(latency, False, {}, outcome.error or f"still {outcome.status}")
    return Timed(latency, True, outcome.result.timings.model_dump())


class BulkTally:
    """When each bulk job ended, recorded as they end (a thread on the bulk producer's `wait`)."""

    def __init__(self, producer, ids: list[str]):
        self.start = time.perf_counter()
        self.ended: list[tuple[float, bool]] = []  # (perf_counter, finished with a result)
        self.first_ended = threading.Event()
        self.thread = threading.Thread(target=self._collect, args=(producer, ids), daemon=True)
        self.thread.start()

    def _collect(self, producer, ids: list[str]) -> None:
        for outcome in producer.wait(ids, timeout=3600):
            self.ended.append((time.perf_counter(), outcome.result is not None))
            self.first_ended.set()

    def join(self) -> None:
        self.thread.join(timeout=600)

    def report(self, window_start: float, window_end: float, queued: list[int]) -> dict:
        """Bulk images/s alone (first result to `window_start`: the pipeline already full) and
        during the interactive window; the fewest bulk jobs seen queued in Redis meanwhile."""
        done = sorted(t for t, ok in self.ended if ok)
        first = done[0] if done else window_start
        alone = [t for t in done if first < t <= window_start]
        during = [t for t in done if window_start < t <= window_end]
        return {
            "bulk_images_per_s_alone": len(alone) / (window_start - first) if window_start > first else None,
            "bulk_images_per_s_mixed": len(during) / (window_end - window_start),
            "bulk_done_mixed": len(during),
            "bulk_done": len(done),
            "bulk_queued_min": min(queued) if queued else 0,
            "saturated": bool(queued) and min(queued) > 0,
        }


def latency_summary(timed: list[Timed], prefix: str) -> dict:
    latencies = [t.latency_s for t in timed if t.ok]
    return {f"{prefix}_p50_s": percentile(latencies, 50), f"{prefix}_p99_s": percentile(latencies, 99)}


SPLIT_PARTS = ("queued_s", "preprocess_s", "first_token_s", "engine_s", "total_s")


def split_summary(timed: list[Timed], pct: float) -> dict:
    """A percentile of each part of the worker's split of the successful jobs' latency (each part
    on its own: the parts at p99 come from different jobs). `first_token_s` counts from submission."""
    return {
        part: percentile([t.timings[part] for t in timed if t.ok and t.timings.get(part) is not None], pct)
        for part in SPLIT_PARTS
    }


def timeline_summary(stats: dict, count: int, pct: float) -> dict:
    """A percentile of the seconds from `add` to each milestone in the engine, over the last
    `count` high-lane sequences (the interactive jobs beside bulk; fast engine's stats)."""
    timelines = (stats.get("high_lane_timelines") or [])[-count:]
    keys = sorted({key for timeline in timelines for key in timeline})
    return {key: percentile([t[key] for t in timelines if key in t], pct) for key in keys}


def job_splits(timed: list[Timed]) -> list[dict]:
    """Each successful job's split, rounded, in arrival order (where a slow job's time went)."""
    return [{part: round(t.timings.get(part) or 0.0, 4) for part in SPLIT_PARTS} for t in timed if t.ok]


def mixed_report(bench: MixedBench, idle: list[Timed], mixed: list[Timed], bulk: dict, start_s: float, stats: dict):
    summary = {**latency_summary(mixed, "interactive"), **latency_summary(idle, "idle")}
    errors = [t.error for t in idle + mixed if not t.ok]
    return {
        "gpu": device_name(bench.device),
        "command": bench.command,
        "preset": bench.preset,
        **summary,
        "p99_ratio": summary["interactive_p99_s"] / summary["idle_p99_s"],
        "p50_ratio": summary["interactive_p50_s"] / summary["idle_p50_s"],
        **bulk,
        "interactive_jobs": len(mixed),
        "rate_per_s": bench.rate,
        "bulk_images": bench.bulk_images,
        "lead_s": bench.lead_s,
        "new_tokens": bench.new_tokens,
        "bulk_new_tokens": bench.bulk_new_tokens or bench.new_tokens,
        "batch_size": bench.batch_size,
        "high_lane_slots": bench.high_lane_slots,
        "engine": bench.engine,
        "engine_options": bench.engine_options,
        "idle_split_p50": split_summary(idle, 50),
        "interactive_split_p50": split_summary(mixed, 50),
        "idle_split_p99": split_summary(idle, 99),
        "interactive_split_p99": split_summary(mixed, 99),
        "interactive_splits": job_splits(mixed),
        "interactive_engine_timeline_p50": timeline_summary(stats, len(mixed), 50),
        "interactive_engine_timeline_p99": timeline_summary(stats, len(mixed), 99),
        "idle_latencies_s": [round(t.latency_s, 4) for t in idle],
        "interactive_latencies_s": [round(t.latency_s, 4) for t in mixed],
        "error_count": len(errors),
        "errors": errors[:5],
        "worker_start_s": start_s,
        "engine_stats": stats,
    }


def write_mixed_report(report: dict, folder: Path) -> list[Path]:
    """mixed-<gpu>.json and .png (interactive p50 / p99, idle and beside bulk)."""
    from wicore.bench.plots import write_report
    from wicore.bench.report import gpu_slug

    keys = {"idle\np50": "idle_p50_s", "idle\np99": "idle_p99_s",
            "beside bulk\np50": "interactive_p50_s", "beside bulk\np99": "interactive_p99_s"}  # fmt: skip
    bars = {label: 1000 * report[key] for label, key in keys.items()}
    title = (
        f"Interactive jobs at {report['rate_per_s']:g}/s, {report['preset']}, {report['gpu']}\n"
        f"p99 beside bulk = {report['p99_ratio']:.2f}x idle; bulk {report['bulk_images_per_s_mixed']:.1f} images/s"
    )
    return write_report(report, folder / f"mixed-{gpu_slug(report['gpu'])}", title, bars, "latency (ms)")


def print_mixed_report(report: dict) -> None:
    from wicore.bench.report import print_table

    bulk = f"{_rate(report['bulk_images_per_s_alone'])} / {_rate(report['bulk_images_per_s_mixed'])}"
    print_table(f"wicore bench mixed ({report['gpu']})", [
        ("interactive p50 / p99, idle", f"{report['idle_p50_s']:.3f} s / {report['idle_p99_s']:.3f} s"),
        ("interactive p50 / p99, beside bulk", f"{report['interactive_p50_s']:.3f} s / {report['interactive_p99_s']:.3f} s"),
        ("p99 ratio (target <= 2)", f"{report['p99_ratio']:.2f}x"),
        ("bulk images/s alone / beside", bulk),
        ("bulk queued throughout", f"{report['saturated']} (fewest queued: {report['bulk_queued_min']})"),
        ("errors", str(report["error_count"])),
    ])  # fmt: skip


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
