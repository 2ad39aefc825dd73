"""`wicore enqueue`, `wicore result`, `wicore status`: the verbs of a service that only submits.
They import neither torch nor transformers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from wicore.cli.common import (
    ConfigOption,
    ImageColumnOption,
    KeyColumnOption,
    ModelIdOption,
    PromptColumnOption,
    RedisOption,
    RedisPasswordFileOption,
    S3EndpointOption,
    console,
    dataset_options,
    friendly_errors,
    settings_from,
)
from wicore.cli.failures import DebugOption, ExitCode, debug_level
from wicore.cli.input_paths import InputItem, iter_inputs
from wicore.cli.redis_check import connect_shards
from wicore.cli.submitting import WINDOWS_IN_FLIGHT, FlowLimits
from wicore.models import model_dir_and_id
from wicore.redaction import redact
from wicore.schemas import Lane

ID_FILE_HELP = "Job ids printed by `wicore enqueue`, or - to read its output (id, tab, input per line) from stdin."


@friendly_errors
def enqueue(
    inputs: list[str] = typer.Argument(
        ...,
        help="Image files, folders (recursive), JSONL manifests, Parquet files, WebDataset tar shards, `datasets` "
        "folders (save_to_disk), s3:// objects or prefixes, globs of these.",
    ),
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    model_id: str = ModelIdOption,
    model: Path = typer.Option(None, help="Checkpoint dir (only its name is used, as the model id)."),
    prompt: str = typer.Option(None, help="Prompt (default: 'Describe this image in detail.')."),
    max_new_tokens: int = typer.Option(
        None, min=1, max=32_768, help="Most tokens to generate (default: the checkpoint's, else 64)."
    ),
    temperature: float = typer.Option(None, min=0.0, max=100.0, help="0 = greedy (the default)."),
    seed: int = typer.Option(None, min=0, help="Sampling seed."),
    priority: Lane = typer.Option(Lane.NORMAL, help="Lane: high jobs are taken first."),
    deadline_s: float = typer.Option(None, help="Fail jobs not started within this many seconds."),
    by_path: bool = typer.Option(False, help="Send file paths (workers must see them) instead of image bytes."),
    window: bool = typer.Option(
        True,
        help="Flow control: past the window (settings window_jobs, window_bytes) of unfinished jobs and image bytes "
        "in Redis, wait for earlier jobs to end before submitting more, saying so on stderr. --no-window: submit "
        "everything at once (fire and forget).",
    ),
    image_column: str = ImageColumnOption,
    key_column: str = KeyColumnOption,
    prompt_column: str = PromptColumnOption,
    s3_endpoint_url: str = S3EndpointOption,
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Submit images as caption jobs; print one line per input: its job id, a tab, the input
    (the same work gets the same id). Warns when no live worker serves the model."""
    from wicore.producer import ProducerConfig, Submission
    from wicore.producer.shards import producer_over

    settings = settings_from(
        config, redis_url=redis_url, redis_password_file=redis_password_file, model_id=model_id, model=model, s3_endpoint_url=s3_endpoint_url,
        log_level=debug_level(debug),
    )  # fmt: skip
    items = iter_inputs(inputs, dataset_options(settings, image_column, key_column, prompt_column))
    producer_config = ProducerConfig(
        by_path=by_path, result_ttl_s=settings.result_ttl_s, retries=settings.retries,
        max_image_bytes=settings.max_image_bytes, max_images_per_request=settings.max_images_per_request,
        max_queued_jobs=settings.max_queued_jobs, max_queued_high_jobs=settings.max_queued_high_jobs,
        release_blobs=True,
        sampling=settings.sampling_limits,
    )  # fmt: skip
    served_id = model_dir_and_id(settings)[1]
    producer = producer_over(connect_shards(settings.redis_urls), model=served_id, config=producer_config)
    deadline = time.time() + deadline_s if deadline_s is not None else None
    flags = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    given = {key: value for key, value in flags.items() if value is not None}

    def submission(item: InputItem) -> Submission:
        fields = {
            "params": item.generation(given),
            "priority": priority,
            "deadline": deadline,
            "metadata": item.metadata,
        }
        if item.messages is not None:
            return Submission(messages=item.messages, images=item.images, name=item.input, **fields)
        return Submission(item.image, item.prompt or prompt, name=item.input, **fields)

    limits = FlowLimits(settings.window_jobs, settings.window_bytes, by_path) if window else None
    _warn_if_unserved(producer.connections, served_id)  # before a wait on the window, which no worker would end
    failed = _enqueue_items(producer, items, submission, limits)
    if failed:
        raise typer.Exit(ExitCode.FAILED)


def _enqueue_items(producer, items: Iterable[InputItem], submission, limits: FlowLimits | None) -> int:
    """Print `id<TAB>input` per enqueued input and a warning per input that could not be; the
    number of those. With `limits`, at most two windows of jobs are unfinished at once: the
    third waits for the first to end (said once on stderr)."""
    from wicore.cli.submitting import submit_items, windows

    failed = 0
    in_flight: list[list[str]] = []
    said = False

    def on_error(item: InputItem, error: str) -> None:
        nonlocal failed
        failed += 1
        console.print(f"warning: not enqueued: {item.input}: {error}", markup=False)

    for chunk in windows(items, limits) if limits else [items]:
        if limits and len(in_flight) == WINDOWS_IN_FLIGHT:
            if not said:
                console.print(_WAITING.format(jobs=limits.jobs, bytes=limits.bytes), markup=False)
                said = True
            _wait_ended(producer, in_flight.pop(0))
        ids = []
        for job_id, input in submit_items(producer, chunk, submission, on_error):
            typer.echo(f"{job_id}\t{input}", nl=True)
            ids.append(job_id)
        sys.stdout.flush()
        in_flight.append(ids)
    return failed


_WAITING = (
    "waiting: more inputs than the window ({jobs} jobs, {bytes} image bytes in Redis); each next part goes out as "
    "earlier jobs end (--no-window: all at once)"
)


def _wait_ended(producer, job_ids: list[str]) -> None:
    """Until these jobs have ended (or left Redis)."""
    for _ in producer.wait(job_ids, poll_s=1.0):
        pass


def _warn_if_unserved(connections, model_id: str) -> None:
    from wicore.worker.status import served_models

    served = set().union(*(served_models(connection) for connection in connections))
    if model_id not in served:
        serving = ", ".join(sorted(served)) or "none"
        console.print(
            f"warning: no live worker serves model {model_id} (live workers serve: {serving}); its jobs wait until "
            f"one does (a worker still loading its model will take them), or enqueue with the --model-id served",
            markup=False,
        )


@friendly_errors
def result(
    job_ids: list[str] = typer.Argument(..., help=ID_FILE_HELP),
    wait: float = typer.Option(0.0, help="Wait up to this many seconds in all for the jobs to end."),
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Print one JSON line per job as it ends (`wicore schema result`); after --wait seconds,
    an 'unfinished' line for each job still running."""
    from wicore.cli.result_lines import wait_lines
    from wicore.producer.shards import producer_over

    settings = settings_from(
        config, redis_url=redis_url, redis_password_file=redis_password_file, log_level=debug_level(debug)
    )
    inputs_by_job = read_job_ids(job_ids)
    producer = producer_over(connect_shards(settings.redis_urls, write=False), model="any")
    statuses = set()
    for line in wait_lines(producer, inputs_by_job, timeout=wait):
        typer.echo(line.model_dump_json())
        statuses.add(line.status)
    if "unfinished" in statuses:
        raise typer.Exit(ExitCode.UNFINISHED)
    if statuses & {"failed", "canceled", "unknown"}:  # some job has no result
        raise typer.Exit(ExitCode.FAILED)


def read_job_ids(args: list[str]) -> dict[str, list[str | None]]:
    """{job id: its inputs}: ids from the arguments, and `enqueue`'s lines from stdin for '-'."""
    inputs_by_job: dict[str, list[str | None]] = {}
    for arg in args:
        pairs = [_id_and_input(line) for line in sys.stdin if line.strip()] if arg == "-" else [(arg, None)]
        for job_id, input in pairs:
            inputs_by_job.setdefault(job_id, []).append(input)
    return inputs_by_job


def _id_and_input(line: str) -> tuple[str, str | None]:
    job_id, _, input = line.rstrip("\n").partition("\t")
    return job_id.strip(), input or None


@friendly_errors
def status(
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Queues per shape bucket (and whether a live worker serves each), workers with their model,
    engine, device and state, and job counts. With several shards: the sums over all of them,
    then each shard's own tables."""
    from wicore.worker.status import collect_shards

    settings = settings_from(
        config, redis_url=redis_url, redis_password_file=redis_password_file, log_level=debug_level(debug)
    )
    connections = connect_shards(settings.redis_urls, write=False)
    report = collect_shards(connections, [redact(url) for url in settings.redis_urls])
    if as_json:
        typer.echo(json.dumps(report))
        return
    out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 1000)
    out.print(queue_table(report["queues"]))
    out.print(worker_table(report["workers"]))
    for shard in report.get("shards", []):
        out.print(f"shard {shard['shard']}: {shard['url']}")
        out.print(queue_table(shard["queues"]))
        out.print(worker_table(shard["workers"]))


def queue_table(rows: list[dict]) -> Table:
    table = Table("queue (model.lane.crops.prompt.new_tokens)", "queued", "started", "finished", "failed", "served by")
    for q in rows:
        served = "a live worker" if q["served"] else f"no live worker serves {q['model']}"
        table.add_row(q["name"], *(str(q[k]) for k in ("queued", "started", "finished", "failed")), served)
    return table


def worker_table(rows: list[dict]) -> Table:
    table = Table("worker", "model", "engine", "device", "state", "running", "ok", "failed", "counters")
    for w in rows:
        identity = [w[k] or "?" for k in ("model", "engine", "device")]
        counts = [str(w[k]) for k in ("running", "ok", "failed")]
        table.add_row(w["name"], *identity, w["state"], *counts, w["stats_line"])
    return table
