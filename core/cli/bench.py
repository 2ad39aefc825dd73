"""`wicore bench ...`: benchmarks that run wicore and its peer in the same run."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from wicore.bench.report import (
    print_caption_report,
    print_fp8_report,
    print_sampling_report,
    print_scaling_report,
    write_caption_report,
    write_fp8_report,
    write_sampling_report,
    write_scaling_report,
)
from wicore.cli.common import console, friendly_errors
from wicore.cli.failures import require

if TYPE_CHECKING:
    from wicore.bench.caption_bench import CaptionBench

PLOTS = "matplotlib"  # each result's PNG: checked before a run, not at its end

Report = dict[str, Any]
WriteReport = Callable[[Report, Path], list[Path]]  # a bench's files under --out, from its report

app = typer.Typer(help="Benchmarks (each runs its peer in the same run and prints a ratio).", no_args_is_help=True)


def print_written(paths: Iterable[Path]) -> None:
    for path in paths:
        console.print(f"wrote {path}")


def echo_json(report: Report, as_json: bool, hide: Collection[str] = ()) -> None:
    """--json: the report, less the keys in `hide`, as the last line on stdout."""
    if as_json:
        typer.echo(json.dumps({key: value for key, value in report.items() if key not in hide}))


def publish(
    report: Report,
    summary: str,
    write: WriteReport,
    out: Path | None,
    as_json: bool,
    *,
    markup: bool = True,
    hide: Collection[str] = (),
) -> None:
    """A bench's tail: its summary lines, then the files `write` puts under --out (none without
    one), then --json's line (less the keys in `hide`)."""
    console.print(summary, markup=markup)
    if out is not None:
        print_written(write(report, out))
    echo_json(report, as_json, hide)


@app.command()
@friendly_errors
def queue(
    jobs: int = typer.Option(2000, help="Jobs per side."),
    batch_size: int = typer.Option(64, help="Batching worker's batch size."),
    redis_url: str = typer.Option(None, help="Redis to use (default: a fresh embedded one)."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
    out: Path = typer.Option(None, help="Folder to write queue-<host>.json and .png into (e.g. bench/results)."),
) -> None:
    """Batching worker (null engine) vs plain RQ SimpleWorker on the same jobs."""
    if out is not None:
        require(PLOTS)
    from wicore.bench.queue_bench import run_bench, write_results
    from wicore.embedded import redis_url_or_embedded

    with redis_url_or_embedded(redis_url) as url:
        report = run_bench(url, jobs, batch_size)
    summary = (
        f"batching worker: {report['batch_jobs_per_s']:.0f} jobs/s, {report['batch_commands_per_job']} Redis "
        f"commands/job, {report['batch_redis_cpu_us_per_job']} us Redis CPU/job\n"
        f"plain RQ:        {report['rq_jobs_per_s']:.0f} jobs/s, {report['rq_commands_per_job']} Redis "
        f"commands/job, {report['rq_redis_cpu_us_per_job']} us Redis CPU/job\n"
        f"ratio: {report['ratio']:.1f}x\n"
        f"enqueueing: {report['batch_enqueue_commands_per_job']} Redis commands/job, "
        f"{report['batch_enqueue_redis_cpu_us_per_job']} us Redis CPU/job (RQ's enqueue_many: "
        f"{report['rq_enqueue_commands_per_job']}, {report['rq_enqueue_redis_cpu_us_per_job']} us)"
    )
    publish(report, summary, write_results, out, as_json)


@app.command()
@friendly_errors
def batch(
    lines: int = typer.Option(100_000, min=10, help="Lines of the batch (also run at a tenth, for memory)."),
    redis_url: str = typer.Option(None, help="Redis to use (default: a fresh embedded one)."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for batch-<host>.json and .png."),
) -> None:
    """An OpenAI batch through `wicore serve` vs `Producer.submit_many` on the same lines (null
    engine), with the gateway's peak memory at the line count and at a tenth of it."""
    require(PLOTS)
    require("fastapi")  # the gateway it starts
    from wicore.bench.batch_bench import run_bench, write_results
    from wicore.embedded import redis_url_or_embedded

    with redis_url_or_embedded(redis_url) as url:
        report = run_bench(url, lines)
    summary = (
        f"batch:    {report['batch_lines_per_s']:.0f} lines/s end to end (all lines jobs at "
        f"{report['batch_submit_lines_per_s']:.0f} lines/s), output {report['output_bytes']:,} bytes streamed\n"
        f"producer: {report['producer_lines_per_s']:.0f} lines/s with submit_many + wait\n"
        f"ratio: {report['throughput_ratio']:.2f}x; gateway RSS peak {report['gateway_rss_peak_mib']} MiB at "
        f"{lines} lines, {report['gateway_rss_peak_mib_at_tenth']} MiB at {report['tenth_lines']}"
    )
    publish(report, summary, write_results, out, as_json, hide=("rss_samples_mib",))


@app.command()
@friendly_errors
def http(
    jobs: int = typer.Option(2000, help="Jobs per side."),
    redis_url: str = typer.Option(None, help="Redis to use (default: a fresh embedded one)."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for http-<host>.json and .png."),
) -> None:
    """Submitting through the gateway (`wicore serve`) vs the Python producer, on the same jobs."""
    require(PLOTS)
    require("fastapi")  # the gateway it starts
    from wicore.bench.http_bench import run_bench, write_results
    from wicore.embedded import redis_url_or_embedded

    with redis_url_or_embedded(redis_url) as url:
        report = run_bench(url, jobs)
    summary = (
        f"producer: {report['producer_jobs_per_s']:.0f} jobs/s one by one (p50 {report['producer_p50_ms']} ms, "
        f"p99 {report['producer_p99_ms']} ms), {report['producer_bulk_jobs_per_s']:.0f} jobs/s with submit_many\n"
        f"gateway:  {report['gateway_jobs_per_s']:.0f} jobs/s one by one (p50 {report['gateway_p50_ms']} ms, "
        f"p99 {report['gateway_p99_ms']} ms), {report['gateway_bulk_jobs_per_s']:.0f} jobs/s with /v1/jobs/batch\n"
        f"ratio: the gateway costs {report['jobs_per_s_ratio']:.1f}x the producer one by one "
        f"(p50 latency {report['latency_ratio_p50']:.1f}x), {report['bulk_jobs_per_s_ratio']:.1f}x in bulk"
    )
    publish(report, summary, write_results, out, as_json)


@app.command()
@friendly_errors
def burst(
    factor: float = typer.Option(10.0, min=1.0, help="The burst's request rate over the workers' measured rate."),
    seconds: float = typer.Option(5.0, min=1.0, help="How long the burst lasts."),
    wait_s: float = typer.Option(2.0, min=0.1, help="The capped side's max_queued_jobs: this many seconds of work."),
    rate_jobs: int = typer.Option(200, min=1, help="Jobs the workers' rate is measured on."),
    redis_url: str = typer.Option(None, help="Redis to use (default: a fresh embedded one)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for burst-<host>.json and .png."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """The gateway under a burst of chat completions FACTOR x the workers' rate, with admission
    control (max_queued_jobs) and without: latency of the answers and the 429s."""
    require(PLOTS)
    require("fastapi")  # the gateway it starts
    from wicore.bench.burst_bench import run_bench, write_results
    from wicore.embedded import redis_url_or_embedded

    with redis_url_or_embedded(redis_url) as url:
        report = run_bench(url, factor, seconds, wait_s, Path("/tmp/wicore-bench/burst"), rate_jobs)
    summary = (
        f"workers: {report['worker_jobs_per_s']} jobs/s; burst {report['burst_requests_per_s']} requests/s for "
        f"{seconds:g}s\ncapped ({report['capped_cap']} queued): p99 {report['capped_p99_s']} s, "
        f"{report['capped_refused_429']} answered 429\nuncapped: p99 {report['uncapped_p99_s']} s"
    )
    publish(report, summary, write_results, out, as_json, markup=False)


@app.command()
@friendly_errors
def stream(
    preset: str = typer.Option(
        "gemma3-4b", help="gemma3-4b (CUDA), or tiny (CPU: tests the mechanism, not the number)."
    ),
    requests: int = typer.Option(None, min=1, help="Chat completions per side [256; tiny 48]."),
    concurrency: int = typer.Option(None, min=1, help="Requests in flight at once [64; tiny 8]."),
    new_tokens: int = typer.Option(None, min=1, help="Tokens of every answer (ignore_eos) [128; tiny 32]."),
    batch_size: int = typer.Option(None, min=1, help="Engine running sequences [256; tiny 16]."),
    engine_option: list[str] = typer.Option(None, "--engine-option", help="KEY=VALUE engine option; repeatable."),
    workdir: Path = typer.Option(Path("/tmp/wicore-stream-bench"), help="Scratch folder (model, images, logs)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for stream-<preset>-<device>.json and .png."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Time to the first streamed token (p50/p99) beside the whole non-streamed answer, in one
    run through `wicore serve` and one fast-engine worker."""
    require(PLOTS)
    require("fastapi")  # the gateway it starts
    from dataclasses import replace

    from wicore.bench.stream_bench import PRESETS, StreamBench, run_stream_bench, write_stream_report
    from wicore.cli.common import engine_options
    from wicore.errors import ConfigError

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    bench = StreamBench(workdir=workdir, preset=preset, **PRESETS[preset])
    given: dict[str, Any] = {
        "requests": requests,
        "concurrency": concurrency,
        "new_tokens": new_tokens,
        "batch_size": batch_size,
    }
    bench = replace(bench, **{k: v for k, v in given.items() if v is not None})
    if engine_option:
        bench = replace(bench, engine_options={**bench.engine_options, **engine_options(engine_option)})
    report = run_stream_bench(bench)
    summary = (
        f"streamed: first token p50 {report['streamed_ttft_p50_s']} s, p99 {report['streamed_ttft_p99_s']} s; "
        f"last token p50 {report['streamed_total_p50_s']} s\n"
        f"whole:    answer p50 {report['whole_total_p50_s']} s, p99 {report['whole_total_p99_s']} s"
    )
    publish(report, summary, write_stream_report, out, as_json)


@app.command()
@friendly_errors
def flow(
    photos: int = typer.Option(5000, min=1, help="Distinct ~420 KB photos captioned (made once under --workdir)."),
    engine: str = typer.Option("null", help="The workers' engine (null: the queue path alone, cheap on a CPU)."),
    unbounded: bool = typer.Option(True, help="Also run without a window (every input at once), in the same run."),
    window_jobs: int = typer.Option(
        None, min=1, help="The window side's window_jobs (default: the setting's).", show_default=False
    ),
    window_bytes: int = typer.Option(
        None, min=0, help="The window side's window_bytes (default: the setting's).", show_default=False
    ),
    workdir: Path = typer.Option(Path("/tmp/wicore-bench/flow"), help="Scratch folder (photos, outputs)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for flow-<engine>-<photos>.json."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Redis' memory under `wicore caption --redis-url` over many photos: its used_memory peak with
    the flow-control window at its default (window_jobs, window_bytes) and unbounded."""
    from functools import partial

    from wicore.bench.flow_bench import FlowBench, run_flow_bench, write_flow_report

    given = {"window_jobs": window_jobs, "window_bytes": window_bytes}
    env = {f"WICORE_{key.upper()}": str(value) for key, value in given.items() if value is not None}
    report = run_flow_bench(FlowBench(workdir, photos=photos, engine=engine, unbounded=unbounded, env=env))
    flags = [f"--{key.replace('_', '-')} {value}" for key, value in given.items() if value is not None]
    command = [f"wicore bench flow --photos {photos} --engine {engine}", *flags]
    report["command"] = " ".join(command + ([] if unbounded else ["--no-unbounded"]))
    name = f"flow-{engine}-{photos}" + "".join(f"-{key}-{value}" for key, value in given.items() if value is not None)
    write = partial(write_flow_report, name=name.replace("_", "-"))
    publish(report, flow_summary(report), write, out, as_json, markup=False)


def print_flow(report: Report) -> None:
    console.print(flow_summary(report), markup=False)


def flow_summary(report: Report) -> str:
    """The photos, then a line per side: Redis' peak over its start, images/s, blobs left."""
    mib = 2**20
    lines = [f"{report['photos']} photos, {report['photo_bytes_total'] / mib:.0f} MiB"]
    for side in ("window", "unbounded"):
        if f"{side}_wall_s" in report:
            lines.append(
                f"{side}: Redis peak {report[f'{side}_redis_peak_over_start_bytes'] / mib:.1f} MiB over start, "
                f"{report[f'{side}_images_per_s']} images/s, {report[f'{side}_blobs_left']} blobs left"
            )
    return "\n".join(lines)


@app.command()
@friendly_errors
def crowd(
    requests: int = typer.Option(500, min=1, help="Concurrent requests of each kind."),
    redis_url: str = typer.Option(None, help="Redis to use (default: a fresh embedded one)."),
    out: Path = typer.Option(Path("bench/results/crowd"), help="Folder for the gateway's and worker's logs."),
) -> None:
    """Concurrent chat completions and long-polls on one gateway (`wicore serve`, a null-engine
    worker): each must get its answer or a 429; the gateway's memory and descriptors before/after.
    Prints one JSON line; exits 1 if any request got another answer."""
    require("fastapi")  # the gateway it starts
    from wicore.bench.crowd_bench import failures, run_bench
    from wicore.embedded import redis_url_or_embedded

    with redis_url_or_embedded(redis_url) as url:
        report = run_bench(url, requests, out)
    typer.echo(json.dumps(report))
    if failures(report):
        console.print("; ".join(failures(report)), markup=False)
        raise typer.Exit(1)


@app.command()
@friendly_errors
def caption(
    preset: str = typer.Option(
        "gemma3-4b", help="Model shape, seeded weights: gemma3-4b, gemma3-12b or gemma3-27b (as `wicore make-model`)."
    ),
    images: int = typer.Option(1024, help="Timed images (distinct, mixed sizes); per GPU with --gpus."),
    batch_size: int = typer.Option(384, help="Engine running sequences and claim size."),
    engine: str = typer.Option("fast", help="Engine under test."),
    engine_option: list[str] = typer.Option(None, "--engine-option", help="KEY=VALUE engine option; repeatable."),
    hf_batches: str = typer.Option("8,32,64", help="Static batch sizes of the HF peer."),
    hf_images: int = typer.Option(128, help="Images per batched HF peer run."),
    hf_repeats: int = typer.Option(3, min=1, help="Timed passes of each batched HF peer; its fastest counts."),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="Run the HF peer (--no-hf: the product alone, for A/B runs)."),
    decode_processes: int = typer.Option(
        None, min=0, help="The worker's --decode-processes (0: threads).", show_default=False
    ),
    sample_stacks: bool = typer.Option(
        False, help="Sample the worker's loop thread: where the host spends its time goes in the JSON (host_stacks)."
    ),
    gpus: int = typer.Option(
        0,
        min=0,
        help="0: the plain worker on one GPU against HF generate and the roofline. N: the product on GPUs "
        "0..N-1 (`wicore worker --gpus`) and on one GPU (the plain worker), in the same run: "
        "caption-<preset>-<gpu>-xN.json.",
    ),
    dtype: str = typer.Option(
        "bfloat16",
        help="bfloat16, or fp8: the product in bf16 and with FP8 GEMMs on the same images in the same run (HF "
        "once), their token agreement and the demo captioner's accuracy in both: caption-<preset>-fp8-<gpu>.json. "
        "With --gpus N, both sides of the scaling run use FP8 GEMMs: caption-<preset>-fp8-<gpu>-xN.json.",
    ),
    variant: str = typer.Option(
        "one-image",
        help="What a prompt holds, on both sides: one-image; two-images (--images N: N / 2 prompts of two images, "
        "images/s and prompts/s); text-only (N text prompts, prompts/s and output tokens/s). The report: "
        "caption-<preset>-<variant>-<gpu>.json. Not with --gpus.",
    ),
    compare_window: bool = typer.Option(
        False,
        help="`wicore caption --redis-url` over --images ~420 KB photos with the flow-control window at its default "
        "and unbounded, in the same run (no HF peer): images/s and Redis' memory peak of each, "
        "caption-window-<preset>-<gpu>.json.",
    ),
    sampling: str = typer.Option(
        None,
        help='Generation parameters as JSON, e.g. \'{"repetition_penalty": 1.1, "frequency_penalty": 0.5, '
        '"logprobs": true, "top_logprobs": 5}\': a second product run on the same images in the same run with '
        "them on every job, beside the usual one: caption-<preset>-sampling-<gpu>.json (its `sampling` key).",
        show_default=False,
    ),
    guided_schema: Path = typer.Option(
        None,
        help="A JSON schema file: the same images free and with this schema on every job (`guided`), one run, "
        "each on a fresh worker (--dtype fp8: both with FP8 GEMMs); images/s, output tokens/s and their ratios "
        "in caption-<preset>-guided-<gpu>.json. No HF peer.",
        show_default=False,
    ),
    workdir: Path = typer.Option(Path("/tmp/wicore-bench"), help="Scratch folder (model config, images, logs)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for the JSON and the PNG."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Bulk captioning on the GPU: the whole product vs HF generate, with the roofline; with
    --gpus N, the whole product on N GPUs vs on one; with --dtype fp8, bf16 vs FP8 GEMMs; with
    --variant, two images a prompt or text only; with --compare-window, the flow-control window at its
    default vs unbounded; with --sampling, without vs with those generation parameters on every job; with
    --guided-schema, free vs constrained."""
    require(PLOTS)
    from wicore.bench.caption_bench import CaptionBench
    from wicore.cli.common import engine_options

    check_caption_flags(preset, dtype, variant, gpus)
    bench = CaptionBench(
        workdir=workdir, preset=preset, images=images, batch_size=batch_size, engine=engine,
        engine_options=engine_options(engine_option), hf_batches=batch_sizes(hf_batches),
        hf_images=hf_images, hf_repeats=hf_repeats, hf_peers=hf, decode_processes=decode_processes,
        sample_stacks=sample_stacks, gpus=gpus, variant=variant,
    )  # fmt: skip
    plan = caption_plan(bench, out, dtype, guided_schema, sampling, compare_window)
    mode = CAPTION_MODES[plan.mode]
    report = mode.run(plan)
    publish_caption(mode, report, plan)
    echo_json(report, as_json, hide=[key for key in report if key.startswith("engine_stats")])


def check_caption_flags(preset: str, dtype: str, variant: str, gpus: int) -> None:
    """The flags every mode reads, checked before anything runs."""
    from wicore.bench.caption_variants import images_per_prompt
    from wicore.errors import ConfigError
    from wicore.models.gemma3 import SEEDED_PRESETS

    if preset not in SEEDED_PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(SEEDED_PRESETS)}")
    if dtype not in ("bfloat16", "fp8"):
        raise ConfigError(f"--dtype {dtype}: use bfloat16 or fp8")
    images_per_prompt(variant)  # a ConfigError naming the variants
    if gpus and variant != "one-image":
        raise ConfigError(f"--variant {variant} runs on one GPU (--gpus 0); the scaling run sends one image a prompt")


def batch_sizes(text: str) -> tuple[int, ...]:
    """--hf-batches "8,32,64" -> (8, 32, 64); ConfigError unless every one is a positive integer."""
    from wicore.errors import ConfigError

    parts = text.split(",")
    sizes = tuple(int(part) for part in parts if part.strip().isdigit())
    if len(sizes) != len(parts) or 0 in sizes:
        raise ConfigError(f"--hf-batches {text}: give positive integers separated by commas, e.g. 8,32,64")
    return sizes


@dataclass(frozen=True)
class CaptionPlan:
    """The one run `bench caption` makes: its mode (a key of CAPTION_MODES), its bench config and
    what that mode alone reads."""

    mode: str
    bench: CaptionBench
    out: Path
    sampling: dict = field(default_factory=dict)  # --sampling's generation parameters
    guided: dict = field(default_factory=dict)  # --guided-schema's spec


def caption_plan(
    bench: CaptionBench, out: Path, dtype: str, guided_schema: Path | None, sampling: str | None, compare_window: bool
) -> CaptionPlan:
    """The mode the flags ask for, its own flags checked: the first of --guided-schema, --sampling,
    --compare-window and --gpus N given, else --dtype's (fp8, or bf16 against HF generate)."""
    from wicore.bench.caption_fp8 import fp8_variant
    from wicore.bench.caption_guided import load_schema
    from wicore.errors import ConfigError

    fp8 = dtype == "fp8"
    if guided_schema is not None:
        return CaptionPlan("guided", fp8_variant(bench) if fp8 else bench, out, guided=load_schema(guided_schema))
    if sampling is not None:
        if bench.gpus or fp8:
            raise ConfigError("--sampling runs on its own: without --gpus and --dtype fp8")
        return CaptionPlan("sampling", bench, out, sampling=sampling_params(sampling))
    if compare_window:
        return CaptionPlan("window", bench, out)
    if bench.gpus:
        return CaptionPlan("scaling", fp8_variant(bench) if fp8 else bench, out)
    return CaptionPlan("fp8" if fp8 else "vs-hf", bench, out)


def sampling_params(text: str) -> dict:
    """`--sampling`'s JSON, checked as generation parameters (a bad one is a ConfigError naming it)."""
    from pydantic import ValidationError

    from wicore.errors import ConfigError
    from wicore.schemas import GenerationParams

    try:
        given = json.loads(text)
        GenerationParams.model_validate(given)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--sampling: not JSON ({exc})") from None
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, GenerationParams, "--sampling field") from None
    if not isinstance(given, dict) or not given:
        raise ConfigError("--sampling: give a JSON object of generation parameters")
    return given


@dataclass(frozen=True)
class CaptionMode:
    """One way `bench caption` runs: `run` measures and returns the report, `write` puts its files
    under --out, `show` prints its summary."""

    run: Callable[[CaptionPlan], Report]
    write: Callable[[Report, CaptionPlan], list[Path]]
    show: Callable[[Report], None]
    summary_first: bool = False  # the window's summary comes before its file, as `bench flow` prints it


def publish_caption(mode: CaptionMode, report: Report, plan: CaptionPlan) -> None:
    """The mode's files under --out and its summary, in the mode's order."""
    if mode.summary_first:
        mode.show(report)
    print_written(mode.write(report, plan))
    if not mode.summary_first:
        mode.show(report)


def run_vs_hf(plan: CaptionPlan) -> Report:
    from wicore.bench.caption_bench import run_caption_bench

    return run_caption_bench(plan.bench)


def run_fp8(plan: CaptionPlan) -> Report:
    from wicore.bench.caption_fp8 import run_fp8_bench

    return run_fp8_bench(plan.bench)


def run_scaling(plan: CaptionPlan) -> Report:
    from wicore.bench.caption_scaling import gpu_count_check, run_scaling_bench
    from wicore.cli.worker_specs import cuda_device_count

    gpu_count_check(plan.bench.gpus, cuda_device_count())
    return run_scaling_bench(plan.bench)


def run_sampling(plan: CaptionPlan) -> Report:
    from wicore.bench.caption_sampling import run_sampling_bench

    return run_sampling_bench(plan.bench, plan.sampling)


def run_guided(plan: CaptionPlan) -> Report:
    from wicore.bench.caption_guided import run_guided_bench

    return run_guided_bench(plan.bench, plan.guided)


def run_window(plan: CaptionPlan) -> Report:
    """`wicore caption --redis-url` with the window at its default vs unbounded, on the preset's
    seeded model on the bench's device."""
    from wicore.bench.flow_bench import FlowBench, run_flow_bench
    from wicore.models.gemma3 import make_seeded

    bench = plan.bench
    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = bench.model_dir or make_seeded(bench.workdir / bench.preset, bench.preset)
    args = ("--model", str(model_dir), "--model-id", bench.preset, "--device", bench.device, "--batch-size",
            str(bench.batch_size), "--max-new-tokens", str(bench.new_tokens), "--allow-random-weights")  # fmt: skip
    flow = FlowBench(bench.workdir / "flow", photos=bench.images, engine=bench.engine, caption_args=args)
    report = run_flow_bench(flow)
    report["command"] = f"wicore bench caption --preset {bench.preset} --images {bench.images} --compare-window"
    return report


def under_out(write: WriteReport) -> Callable[[Report, CaptionPlan], list[Path]]:
    """A bench's writer of files into a folder, as a mode's: the folder is --out."""
    return lambda report, plan: write(report, plan.out)


def write_guided(report: Report, plan: CaptionPlan) -> list[Path]:
    from wicore.bench.caption_guided import write_guided_report

    return write_guided_report(report, plan.out)


def write_window(report: Report, plan: CaptionPlan) -> list[Path]:
    """caption-window-<preset>-<gpu>.json."""
    from wicore.bench.caption_bench import device_name
    from wicore.bench.flow_bench import write_flow_report

    gpu = device_name(plan.bench.device).replace(" ", "-")
    return write_flow_report(report, plan.out, f"caption-window-{plan.bench.preset}-{gpu}")


def print_guided(report: Report) -> None:
    free, constrained = report["free"], report["constrained"]
    console.print(
        f"free {free['images_per_s']:.2f} images/s, constrained {constrained['images_per_s']:.2f} images/s: "
        f"ratio {report['images_per_s_ratio']:.3f} (output tokens/s ratio {report['output_tokens_per_s_ratio']:.3f})"
    )
    console.print(f"guided host per step (ms): {json.dumps(report['guided_host'])}")


CAPTION_MODES = {
    "vs-hf": CaptionMode(run_vs_hf, under_out(write_caption_report), print_caption_report),
    "fp8": CaptionMode(run_fp8, under_out(write_fp8_report), print_fp8_report),
    "scaling": CaptionMode(run_scaling, under_out(write_scaling_report), print_scaling_report),
    "sampling": CaptionMode(run_sampling, under_out(write_sampling_report), print_sampling_report),
    "guided": CaptionMode(run_guided, write_guided, print_guided),
    "window": CaptionMode(run_window, write_window, print_flow, summary_first=True),
}


@app.command("fp8-layers")
@friendly_errors
def fp8_layers(
    compile: bool = typer.Option(
        True, "--compile/--no-compile", help="Also time the layers compiled as the engine runs them (~2 min)."
    ),
    repeats: int = typer.Option(20, min=3, help="Timed calls per figure (their median)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for fp8-layers-<gpu>.json."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """FP8 GEMMs per layer at Gemma-3-4B's shapes (GPU): each GEMM, one vision-tower layer and one
    decoder layer's dense part, bf16 against FP8 (rowwise, as the engine runs it, and tensorwise)."""
    import torch

    from wicore.bench.fp8_layers import print_fp8_layers, run_fp8_layers, write_fp8_layers
    from wicore.errors import ConfigError
    from wicore.models.gemma3 import gemma3_4b_config
    from wicore.ops.fp8 import unsupported_reason

    reason = unsupported_reason(torch.device("cuda"))
    if reason is not None:
        raise ConfigError(f"bench fp8-layers needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper): {reason}")
    report = run_fp8_layers(gemma3_4b_config(), compile=compile, repeats=repeats)
    print_written([write_fp8_layers(report, out)])
    print_fp8_layers(report)
    echo_json(report, as_json)


@app.command()
@friendly_errors
def kernels(
    images: int = typer.Option(512, min=1, help="Profiled images (after the warm-up ones)."),
    batch_size: int = typer.Option(384, min=1, help="Engine running sequences."),
    engine_option: list[str] = typer.Option(None, "--engine-option", help="KEY=VALUE engine option; repeatable."),
    dtype: str = typer.Option("bfloat16", help="bfloat16, or fp8 (engine option gemm_dtype=fp8)."),
    workdir: Path = typer.Option(Path("/tmp/wicore-kernels"), help="Scratch folder (model, images, the trace)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for kernels-gemma3-4b-<dtype>-<gpu>.json and .png."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Where the device's time goes on the caption workload (GPU): the fast engine on Gemma-3-4B's
    shape under torch.profiler, each kernel's time by kind and by stream, per image, against the
    wall and the roofline's compute time per phase."""
    require(PLOTS)
    import torch

    from wicore.bench.kernel_profile import KernelBench, print_kernel_profile, run_kernel_profile, write_kernel_profile
    from wicore.cli.common import engine_options
    from wicore.errors import ConfigError

    if dtype not in ("bfloat16", "fp8"):
        raise ConfigError(f"--dtype {dtype}: use bfloat16 or fp8")
    if not torch.cuda.is_available():
        raise ConfigError("bench kernels profiles CUDA kernels: run it on a machine with an NVIDIA GPU")
    options = engine_options(engine_option) | ({"gemm_dtype": "fp8"} if dtype == "fp8" else {})
    report = run_kernel_profile(
        KernelBench(workdir=workdir, images=images, batch_size=batch_size, engine_options=options)
    )
    print_written(write_kernel_profile(report, out))
    print_kernel_profile(report)
    echo_json(report, as_json)


@app.command()
@friendly_errors
def mixed(
    preset: str = typer.Option(
        "gemma3-4b", help="gemma3-4b (CUDA), or tiny (CPU: tests the mechanism, not the number)."
    ),
    bulk_images: int = typer.Option(None, min=1, help="Bulk jobs queued at once in phase 2 [6144; tiny 400]."),
    interactive: int = typer.Option(None, min=2, help="Interactive (high-lane) jobs per phase [120; tiny 20]."),
    rate: float = typer.Option(None, min=0.01, help="Interactive jobs per second [1; tiny 2]."),
    lead_s: float = typer.Option(
        None,
        min=0,
        help="Seconds of bulk alone, from its first result, before phase 2's interactive jobs [10; tiny 3].",
    ),
    new_tokens: int = typer.Option(None, min=1, help="New tokens of an interactive job [64; tiny 32]."),
    bulk_new_tokens: int = typer.Option(None, min=1, help="New tokens of a bulk job [as --new-tokens; tiny 256]."),
    batch_size: int = typer.Option(None, min=1, help="Engine running sequences [384; tiny 16]."),
    high_lane_slots: int = typer.Option(None, min=0, help="Worker slots kept for the high lane [batch size / 16]."),
    engine_option: list[str] = typer.Option(None, "--engine-option", help="KEY=VALUE engine option; repeatable."),
    workdir: Path = typer.Option(Path("/tmp/wicore-mixed-bench"), help="Scratch folder (model, images, worker log)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for mixed-<gpu>.json and .png."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Interactive high-lane jobs at a steady rate on an idle worker, then beside a bulk run that
    keeps the worker full, in one run: their p50/p99 latency (submit to result) both ways."""
    require(PLOTS)
    from wicore.bench.mixed_bench import preset_bench, print_mixed_report, run_mixed_bench, write_mixed_report
    from wicore.cli.common import engine_options

    bench = preset_bench(
        preset, workdir, bulk_images=bulk_images, interactive=interactive, rate=rate, lead_s=lead_s,
        new_tokens=new_tokens, bulk_new_tokens=bulk_new_tokens, batch_size=batch_size, high_lane_slots=high_lane_slots,
        engine_options=engine_options(engine_option) or None,
    )  # fmt: skip
    report = run_mixed_bench(bench)
    print_written(write_mixed_report(report, out))
    print_mixed_report(report)
    echo_json(report, as_json, hide=("engine_stats",))


@app.command("cache")
@friendly_errors
def cache_bench(
    images: int = typer.Option(256, help="VQA images (each asked several questions)."),
    questions: int = typer.Option(4, help="Questions per image (at most 4)."),
    dup_images: int = typer.Option(1024, help="Captions in the 30%-duplicates run."),
    repeats: int = typer.Option(3, min=1, help="Timed VQA runs per config, each on new images (median)."),
    workdir: Path = typer.Option(Path("/tmp/wicore-cache-bench"), help="Scratch folder."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for the JSON and the plots."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Tier caches on the GPU: VQA speedup, CPU-tier restore bandwidth, duplicates, policies; the device's busy share
    of each timed run."""
    require(PLOTS)
    from wicore.bench.cache_bench import CacheBench, run_cache_bench
    from wicore.bench.cache_report import write_cache_report

    bench = CacheBench(workdir=workdir, images=images, questions=questions, dup_images=dup_images, repeats=repeats)
    report = run_cache_bench(bench)
    print_written(write_cache_report(report, out))
    keys = ("gpu", "vqa_speedup", "restore_bw_fraction", "restore_bw_fraction_batched", "dup30_speedup")
    console.print({k: report[k] for k in keys})
    echo_json(report, as_json, hide=("vqa", "dup30"))


@app.command("fidelity")
@friendly_errors
def fidelity_bench(
    model: str = typer.Option("democap", help="democap (the trained demo captioner) or gemma3-4b (random weights)."),
    images: int = typer.Option(None, min=1, help="Images, each asked every round's prompt (democap 1000, 4B 256)."),
    device: str = typer.Option("cuda", help="cuda or cpu."),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32."),
    batch_size: int = typer.Option(384, min=1, help="Sequences in flight."),
    small_pool_pages: int = typer.Option(None, min=1, help="KV pages of the small pool (democap 2048, 4B 16384)."),
    max_margins: int = typer.Option(256, min=0, help="Differing sequences per config given a float32 margin."),
    engine_option: list[str] = typer.Option(None, "--engine-option", help="KEY=VALUE for every config; repeatable."),
    tag: str = typer.Option("", help="Suffix of the JSON file's name (e.g. the engine options tried)."),
    workdir: Path = typer.Option(Path("/tmp/wicore-fidelity"), help="Scratch folder (the 4B's config)."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for fidelity-<model>-<gpu>.json."),
    as_json: bool = typer.Option(False, "--json", help="End with one JSON line."),
) -> None:
    """Tokens of the prefix cache's paths against caching off, on a VQA flow with repeated images:
    exact-match accuracy, agreement per round, float32 logit margins where they differ."""
    from wicore.bench.fidelity import FLOWS, FidelityBench, run_fidelity_bench, summary, write_fidelity_report
    from wicore.cli.common import engine_options
    from wicore.errors import ConfigError

    if model not in FLOWS:
        raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(FLOWS)}")
    bench = FidelityBench(
        workdir=workdir, model=model, images=images, device=device, dtype=dtype, batch_size=batch_size,
        small_pool_pages=small_pool_pages, engine_options=engine_options(engine_option), max_margins=max_margins,
    )  # fmt: skip
    report = run_fidelity_bench(bench)
    print_written([write_fidelity_report(report, out, tag)])
    for line in summary(report):
        console.print(line)
    echo_json(report, as_json)
