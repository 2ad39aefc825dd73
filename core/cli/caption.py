"""`wicore caption INPUT... -o OUT.jsonl|OUT.parquet`: bulk captioning through the whole product.

Starts an embedded redis-server unless given --redis-url, starts the workers, submits the inputs
as jobs as they are read (flow control, submitting.py: at most `window_jobs` jobs and `window_bytes`
of their images unfinished in Redis, in two windows; memory and Redis hold a bounded part of a
dataset of any size), and writes one result line per input
(`wicore schema result`) as results arrive. Re-running with the same OUT skips the inputs already
captioned there and tries the ones that failed again (unless --skip-errors), so an interrupted
run resumes where it stopped. One run per OUT at a time (output_file.run_lock).

The run owns its child processes (process_group.py): any end (done, an error, SIGINT, SIGTERM)
stops them, and with an external Redis the jobs it leaves unstarted are removed from it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from wicore.cli.common import (
    AllowRandomWeightsOption,
    BatchSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    ImageColumnOption,
    KeyColumnOption,
    ModelIdOption,
    ModelOption,
    NoCacheOption,
    PromptColumnOption,
    RedisOption,
    RedisPasswordFileOption,
    S3EndpointOption,
    checked_model,
    console,
    dataset_options,
    friendly_errors,
    settings_from,
)
from wicore.cli.failures import (
    DebugOption,
    ExitCode,
    Interrupted,
    debug_level,
    hold_signals,
    raise_on_signals,
)
from wicore.cli.input_paths import InputItem, iter_inputs, local_files
from wicore.cli.output_file import Answers, open_sink, read_answers, run_lock
from wicore.cli.pool import WorkerPool
from wicore.cli.process_group import ProcessGroup
from wicore.cli.result_lines import error_line, wait_lines
from wicore.cli.submitting import WINDOWS_IN_FLIGHT, FlowLimits, submit_items, windows
from wicore.cli.worker_specs import WorkerSpec, plan_workers
from wicore.config import Settings
from wicore.errors import ConfigError
from wicore.redaction import redact
from wicore.schemas import ResultLine

KEEP_RUN_LOGS = 20  # per-run log folders kept in the cache dir


def flow_limits(settings: Settings, workers: int, by_path: bool) -> FlowLimits:
    """The run's window: `window_jobs` from the settings, raised so that each of the two windows
    fills every worker's batch twice over, and `window_bytes` per worker (a window of ~420 KB
    photos at the default holds ~600 a worker: more than a batch of 384)."""
    jobs = max(settings.window_jobs, WINDOWS_IN_FLIGHT * 2 * settings.batch_size * workers)
    return FlowLimits(jobs=jobs, bytes=settings.window_bytes * workers, by_path=by_path)


@friendly_errors
def caption(
    inputs: list[str] = typer.Argument(
        ...,
        help="Image files, folders (recursive; hidden files aside), JSONL manifests, Parquet files, WebDataset tar "
        "shards, `datasets` folders (save_to_disk), s3:// objects or prefixes, globs of these.",
    ),
    output: Path = typer.Option(
        ..., "-o", "--output", help="File to add one line per input to: JSONL, or Parquet for a .parquet name."
    ),
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    engine: str = typer.Option(None, help="reference | fast (default: auto: fast on CUDA)", show_default=False),
    redis_url: str = RedisOption,
    redis_password_file: Path = RedisPasswordFileOption,
    workers: int = typer.Option(
        None, min=1, help="Worker processes to start (each loads the model) [1].", show_default=False
    ),
    gpus: str = typer.Option(None, help="all, or GPU indices (0,1): one worker process per GPU instead of --workers."),
    batch_size: int = BatchSizeOption,
    prompt: str = typer.Option(None, help="Prompt (default: 'Describe this image in detail.')."),
    max_new_tokens: int = typer.Option(
        None, min=1, max=32_768, help="Most tokens to generate per image (default: the checkpoint's, else 64)."
    ),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    redis_dir: Path = typer.Option(None, help="Keep the embedded Redis's data here (default: a temp folder)."),
    no_cache: bool = NoCacheOption,
    engine_option: list[str] = EngineOption,
    skip_errors: bool = typer.Option(False, help="On a rerun, leave inputs that failed before as they are."),
    image_column: str = ImageColumnOption,
    key_column: str = KeyColumnOption,
    prompt_column: str = PromptColumnOption,
    s3_endpoint_url: str = S3EndpointOption,
    allow_random_weights: bool = AllowRandomWeightsOption,
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Caption images into OUT (JSONL, or Parquet for a .parquet name) through Redis, the scheduler
    and the workers. Worker logs go to a folder per run under the cache dir (~/.cache/wicore/logs).
    A second run on the same OUT exits 2 at once, naming the running one."""
    raise_on_signals(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    settings = settings_from(
        config, engine_option=engine_option, redis_url=redis_url, redis_password_file=redis_password_file, model=model, model_id=model_id, engine=engine,
        device=device, dtype=dtype, batch_size=batch_size, no_cache=no_cache, log_level=debug_level(debug),
        s3_endpoint_url=s3_endpoint_url,
    )  # fmt: skip
    run_id = new_run_id()
    specs = plan_workers(f"caption-{run_id}", settings, gpus=gpus, workers=workers)
    check_output_folder(output)
    with run_lock(output):
        answers = read_answers(output)
        options = dataset_options(settings, image_column, key_column, prompt_column)
        todo = Todo(iter_inputs(inputs, options), answers, skip_errors)
        stream = iter(todo)
        first = next(stream, None)
        if first is None:
            console.print(f"nothing to do: all {todo.done} inputs already have a line in {output}", markup=False)
            return
        config = run_config(settings, output, allow_random_weights, prompt, max_new_tokens, redis_dir)
        local = local_files(inputs, options, todo.settled)
        run = CaptionRun(replace(config, file_roots=tuple(sorted(local.roots)), total=local.todo), run_id=run_id)
        run.run(chain([first], stream), specs, answers)
    console.print(run.summary(todo.taken, todo.done), markup=False)
    if run.errors:
        raise typer.Exit(ExitCode.FAILED)


def run_config(
    settings: Settings, output: Path, allow_random_weights: bool, prompt: str | None, max_new_tokens: int,
    redis_dir: Path | None,
) -> RunConfig:  # fmt: skip
    model_dir, served_id = checked_model(settings, allow_random_weights)
    if settings.redis_url:  # reachable, authenticated and writable before any worker starts
        from wicore.cli.redis_check import connect_shards

        for connection in connect_shards(settings.redis_urls):
            connection.close()
    extra = ["--allow-random-weights"] if allow_random_weights else []  # engine options travel in the settings
    return RunConfig(settings, model_dir, served_id, output, prompt, max_new_tokens, redis_dir, tuple(extra))


def check_output_folder(output: Path) -> None:
    if not output.parent.is_dir():
        raise ConfigError(f"-o {output}: the folder {output.parent} does not exist; create it or write elsewhere")


class Todo:
    """The inputs still to run, read as they are taken; counts those OUT already answers."""

    def __init__(self, items: Iterator[InputItem], answers: Answers, skip_errors: bool):
        self.items = items
        self.settled = answers.settled(skip_errors)
        self.done = 0  # inputs skipped: their line is in OUT
        self.taken = 0  # inputs handed out to run

    def __iter__(self) -> Iterator[InputItem]:
        for item in self.items:
            if item.input in self.settled:
                self.done += 1
            else:
                self.taken += 1
                yield item


@dataclass
class Window:
    """Jobs submitted together (their image blobs leave Redis as the last job using each ends)."""

    jobs: dict[str, list[str]]  # job id -> the inputs it answers


class Meter:
    """Captions per second over the time the workers worked: from the first worker ready (its
    model loaded) to now. The progress bar and the final summary both show this rate."""

    def __init__(self) -> None:
        self.ready_at: float | None = None  # unix time
        self.ended = 0  # jobs ended (input errors found before any job was made do not count)
        self.stopped_at: float | None = None

    def rate(self) -> float | None:
        if self.ready_at is None or not self.ended:
            return None
        return self.ended / max(1e-6, (self.stopped_at or time.time()) - self.ready_at)


class RateColumn(ProgressColumn):
    def __init__(self, meter: Meter):
        super().__init__()
        self.meter = meter

    def render(self, task) -> Text:
        rate = self.meter.rate()
        return Text("" if rate is None else f"{rate:.2f} img/s")


def new_run_id() -> str:
    """'20260101-120000-4242': when the run started, and its process."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


@dataclass(frozen=True)
class RunConfig:
    settings: Settings
    model_dir: Path
    model_id: str
    output: Path
    prompt: str | None
    max_new_tokens: int | None
    redis_dir: Path | None
    extra_args: tuple[str, ...] = ()
    file_roots: tuple[Path, ...] = ()  # folders of the image files given (on the embedded Redis, they travel as paths)
    total: int | None = None  # inputs to run, when known before they are read (the progress bar's end)

    @property
    def generation(self) -> dict[str, int]:
        """The generation parameters the command's flags set (a manifest line's win over them)."""
        return {} if self.max_new_tokens is None else {"max_new_tokens": self.max_new_tokens}

    @property
    def embedded(self) -> bool:
        return self.settings.redis_url is None


@dataclass
class CaptionRun:
    config: RunConfig
    written: int = 0
    errors: int = 0
    meter: Meter = field(default_factory=Meter)
    pending: dict[str, list[str]] = field(default_factory=dict)  # job id -> the inputs it answers, until it ends
    started: float = field(default_factory=time.time)
    run_id: str = field(default_factory=new_run_id)
    log_dir: Path | None = None

    def run(self, todo: Iterable[InputItem], specs: list[WorkerSpec], answers: Answers) -> None:
        from wicore.producer import ProducerConfig
        from wicore.producer.shards import producer_over

        group = ProcessGroup()
        with contextlib.ExitStack() as stack:
            stack.callback(group.kill)  # the last word: nothing of this run outlives it
            url = self._redis(stack, group)
            settings = self.config.settings
            config = ProducerConfig(
                by_path=self.config.embedded, result_ttl_s=settings.result_ttl_s, retries=settings.retries,
                max_image_bytes=settings.max_image_bytes, max_images_per_request=settings.max_images_per_request,
                max_queued_jobs=settings.max_queued_jobs, max_queued_high_jobs=settings.max_queued_high_jobs,
                release_blobs=True,
                sampling=settings.sampling_limits,
            )  # fmt: skip
            producer = producer_over(url.split(","), model=self.config.model_id, config=config)
            stack.push(lambda *exc: self._leave(producer, exc[1]))  # runs once the workers have stopped
            self.log_dir = run_log_dir(Path(self.config.settings.cache_dir) / "logs", self.run_id)
            settings = self._worker_settings(url)
            pool = stack.enter_context(WorkerPool(specs, settings, list(self.config.extra_args), group, self.log_dir))
            sink = open_sink(self.config.output, answers)
            stack.callback(sink.close)
            stack.callback(hold_signals)  # the first step of the way out: a second Ctrl-C cannot cut it short
            limits = flow_limits(settings, len(specs), by_path=self.config.embedded)
            self._caption(producer, pool, windows(todo, limits), sink)

    def _redis(self, stack: contextlib.ExitStack, group: ProcessGroup) -> str:
        if not self.config.embedded:
            return self.config.settings.redis_url
        from wicore.embedded import EmbeddedRedis

        keep = self.config.redis_dir is not None
        return stack.enter_context(EmbeddedRedis(self.config.redis_dir, persist=keep, spawn=group.popen)).url

    def _worker_settings(self, url: str) -> Settings:
        """This run's settings as its workers take them (a 0600 file, not the environment)."""
        served = {"redis_url": url, "model": self.config.model_dir, "model_id": self.config.model_id}
        if self.config.embedded:
            served["allowed_roots"] = list(self.config.file_roots)
        return self.config.settings.model_copy(update=served)

    def _caption(self, producer, pool: WorkerPool, windows: Iterable[list[InputItem]], sink) -> None:
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), RateColumn(self.meter)]
        bar = Progress(*columns, TimeRemainingColumn(), console=console, disable=not console.is_terminal)
        with bar as progress:  # a bar on a terminal; in a log or a pipe, only the summary line
            task = progress.add_task("starting workers", total=self.config.total)

            def write(line: ResultLine) -> None:
                sink.write(line)
                self.written += 1
                self.errors += line.error is not None
                progress.advance(task)

            def poll() -> None:
                pool.check()
                if self.meter.ready_at is None:
                    self.meter.ready_at = first_birth(producer.connections, pool.names)
                    progress.update(task, description="captioning" if self.meter.ready_at else "starting workers")

            on_error = lambda item, error: write(error_line(item.input, error))  # noqa: E731
            in_flight: list[Window] = []
            for chunk in windows:
                in_flight.append(self._submit(producer, chunk, on_error))
                if len(in_flight) == WINDOWS_IN_FLIGHT:
                    self._drain(producer, in_flight.pop(0), write, poll)
            while in_flight:
                self._drain(producer, in_flight.pop(0), write, poll)
            self.meter.ready_at = self.meter.ready_at or first_birth(producer.connections, pool.names)
            self.meter.stopped_at = time.time()

    def _submit(self, producer, chunk: list[InputItem], on_error: Callable) -> Window:
        window = Window({})
        for job_id, input in submit_items(producer, chunk, self._submission, on_error):
            self.pending.setdefault(job_id, []).append(input)
            window.jobs.setdefault(job_id, []).append(input)
        return window

    def _drain(self, producer, window: Window, write: Callable, poll: Callable) -> None:
        """Write the window's lines as its jobs end."""
        for line in wait_lines(producer, window.jobs, None, on_poll=poll, poll_s=1.0):
            self.pending.pop(line.job_id, None)
            self.meter.ended += 1
            write(line)

    def _submission(self, item: InputItem):
        from wicore.producer import Submission

        params = item.generation(self.config.generation)
        if item.messages is not None:
            fields = {"messages": item.messages, "images": item.images}
        else:
            fields = {"image": item.image, "prompt": item.prompt or self.config.prompt}
        return Submission(params=params, metadata=item.metadata, name=item.input, **fields)

    def _leave(self, producer, exc: BaseException | None) -> None:
        """After a failure or a signal: say what is left, and take this run's unstarted jobs back
        out of an external Redis (nothing would collect their results)."""
        if exc is None:
            return
        if self.written or isinstance(exc, Interrupted | KeyboardInterrupt):
            exc.add_note(f"{self.written} inputs got their line in {self.config.output}; rerun to do the rest")
        pending = list(self.pending)
        if pending and not self.config.embedded:
            exc.add_note(self._take_back(producer, pending))

    def _take_back(self, producer, pending: list[str]) -> str:
        from redis.exceptions import RedisError

        where = redact(self.config.settings.redis_url)
        try:
            statuses = producer.cancel(pending, own_queued_only=True)
        except RedisError as error:
            return f"could not remove this run's {len(pending)} unfinished jobs from Redis at {where} ({error})"
        removed = sum(status == "canceled" for status in statuses.values())
        running = f" ({len(pending) - removed} were running there and will finish)" if removed < len(pending) else ""
        return f"removed {removed} unstarted jobs of this run from Redis at {where}{running}"

    def summary(self, todo: int, done: int) -> str:
        rate = self.meter.rate()
        speed = "" if rate is None else f", {rate:.2f} images/s once the workers were ready"
        counts = f"captioned {todo - self.errors} of {todo} inputs ({self.errors} errors, {done} already done)"
        return (
            f"{counts} in {time.time() - self.started:.1f}s{speed} -> {self.config.output}; worker logs: {self.log_dir}"
        )


def first_birth(connections: list, names: list[str]) -> float | None:
    """When the first of these workers registered with RQ (its model loaded) on any shard, as unix time."""
    from rq.worker import Worker

    births = []
    for name in names:
        for connection in connections:
            worker = Worker.find_by_key(Worker.redis_worker_namespace_prefix + name, connection=connection)
            if worker is not None and worker.birth_date is not None:
                births.append(worker.birth_date.timestamp())
    return min(births, default=None)


def run_log_dir(logs: Path, run_id: str) -> Path:
    """A new folder for this run's worker logs; the oldest runs' folders go beyond KEEP_RUN_LOGS."""
    runs = sorted(p for p in logs.glob("caption-*") if p.is_dir()) if logs.is_dir() else []
    for old in runs[: max(0, len(runs) - KEEP_RUN_LOGS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    folder = logs / f"caption-{run_id}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
