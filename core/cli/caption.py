"""`wicore caption INPUT... -o OUT.jsonl`: bulk captioning through the whole product.

Starts an embedded redis-server unless given --redis-url, starts the workers, submits every
input as a job, and writes one JSON line per input as results arrive. Re-running with the same
OUT skips the inputs already there, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from wicore.cli.common import (
    BatchSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    ModelIdOption,
    ModelOption,
    NoCacheOption,
    RedisOption,
    console,
    friendly_errors,
)
from wicore.cli.input_paths import InputItem, expand_inputs
from wicore.cli.pool import WorkerPool
from wicore.errors import JobInputError


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text("" if task.speed is None else f"{task.speed:.1f} img/s")


def read_done(output: Path) -> set[str]:
    """Inputs that already have a line in OUT (a torn last line from a crash is ignored)."""
    done: set[str] = set()
    if output.exists():
        for line in output.read_text().splitlines():
            try:
                done.add(json.loads(line)["input"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def line_for(item: InputItem, job_id: str | None, outcome=None, error: str | None = None) -> dict:
    record = {"input": item.input, "job_id": job_id, "text": None, "error": error}
    if outcome is not None and outcome.result is not None:
        r = outcome.result
        record.update(text=r.text, finish_reason=r.finish_reason, output_tokens=r.output_tokens)
        record.update(timings=r.timings.model_dump(), engine=r.engine, model=r.model)
    elif outcome is not None:
        record["error"] = outcome.error
    return record


@friendly_errors
def caption(
    inputs: list[str] = typer.Argument(..., help="Image files, folders (recursive) or JSONL manifests."),
    output: Path = typer.Option(..., "-o", "--output", help="JSONL file to append one line per input to."),
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    engine: str = typer.Option(None, help="reference | fast (default: auto: fast on CUDA)", show_default=False),
    redis_url: str = RedisOption,
    workers: int = typer.Option(1, min=1, help="Worker processes to start (each loads the model)."),
    batch_size: int = BatchSizeOption,
    prompt: str = typer.Option(None, help="Prompt (default: 'Describe this image in detail.')."),
    max_new_tokens: int = typer.Option(64, help="Most tokens to generate per image."),
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    redis_dir: Path = typer.Option(None, help="Keep the embedded Redis's data here (default: a temp folder)."),
    no_cache: bool = NoCacheOption,
    engine_option: list[str] = EngineOption,
    config: Path = ConfigOption,
) -> None:
    """Caption images into OUT.jsonl through Redis, the scheduler and the workers."""
    from wicore.cli.common import model_dir_and_id, settings_from

    settings = settings_from(
        config, engine_option=engine_option, redis_url=redis_url, model=model, model_id=model_id, engine=engine,
        device=device, dtype=dtype, batch_size=batch_size, no_cache=no_cache,
    )  # fmt: skip
    items = list({item.input: item for item in expand_inputs(inputs)}.values())
    done = read_done(output)
    todo = [item for item in items if item.input not in done]
    if not todo:
        console.print(f"nothing to do: all {len(items)} inputs already have a line in {output}")
        return
    model_dir, served_id = model_dir_and_id(settings)  # builds the default model once, before workers race
    start = time.perf_counter()
    counts = _run(settings, todo, output, model_dir, served_id, prompt, max_new_tokens, workers, redis_dir)
    elapsed = time.perf_counter() - start
    console.print(
        f"captioned {counts['ok']} of {len(todo)} inputs ({counts['error']} errors, {len(done)} already done) "
        f"in {elapsed:.1f}s: {len(todo) / elapsed:.2f} images/s -> {output}"
    )


def _run(settings, todo, output, model_dir, served_id, prompt, max_new_tokens, workers, redis_dir) -> dict:
    from wicore.embedded import redis_url_or_embedded
    from wicore.producer import Producer, ProducerConfig

    embedded = settings.redis_url is None
    roots = sorted({item.path.resolve().parent for item in todo if item.path is not None})
    with redis_url_or_embedded(settings.redis_url, redis_dir, keep=redis_dir is not None) as url:
        served = {"redis_url": url, "model": model_dir, "model_id": served_id}
        if embedded:  # the workers read the inputs from where they lie
            served["allowed_roots"] = roots
        log_dir = Path(redis_dir) if redis_dir else Path(tempfile.gettempdir()) / "wicore-logs"
        with WorkerPool(workers, settings.model_copy(update=served), log_dir) as pool, output.open("a") as sink:
            config = ProducerConfig(by_path=embedded, result_ttl_s=settings.result_ttl_s, retries=settings.retries)
            producer = Producer(url, model=served_id, config=config)
            return _caption(producer, pool, todo, sink, prompt, max_new_tokens)


def _caption(producer, pool: WorkerPool, todo: list[InputItem], sink, prompt, max_new_tokens) -> dict[str, int]:
    counts = {"ok": 0, "error": 0}

    def write(record: dict) -> None:
        sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        sink.flush()
        counts["ok" if record["error"] is None else "error"] += 1
        progress.advance(task)

    columns = [TextColumn("captioning"), BarColumn(), MofNCompleteColumn(), RateColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("caption", total=len(todo))
        by_job = _submit(producer, todo, prompt, max_new_tokens, write)
        for outcome in producer.wait(list(by_job), on_poll=pool.check, poll_s=1.0):
            for item in by_job.pop(outcome.job_id):
                write(line_for(item, outcome.job_id, outcome))
    return counts


def _submit(producer, todo: list[InputItem], prompt, max_new_tokens, write, chunk=256) -> dict[str, list[InputItem]]:
    """Submit in chunks; an input the producer cannot read gets its error line at once."""
    by_job: dict[str, list[InputItem]] = {}
    for item in (i for i in todo if i.error):
        write(line_for(item, None, error=item.error))
    good = [i for i in todo if not i.error]
    for begin in range(0, len(good), chunk):
        items = good[begin : begin + chunk]
        try:
            ids = producer.submit_many([_submission(i, prompt, max_new_tokens) for i in items])
        except JobInputError:  # one unreadable file: find it by submitting one by one
            ids = [_submit_one(producer, i, prompt, max_new_tokens, write) for i in items]
        for item, job_id in zip(items, ids):
            if job_id is not None:
                by_job.setdefault(job_id, []).append(item)
    return by_job


def _submit_one(producer, item: InputItem, prompt, max_new_tokens, write) -> str | None:
    try:
        return producer.submit_many([_submission(item, prompt, max_new_tokens)])[0]
    except JobInputError as exc:
        write(line_for(item, None, error=f"{type(exc).__name__}: {exc}"))
        return None


def _submission(item: InputItem, prompt, max_new_tokens):
    from wicore.producer import Submission
    from wicore.schemas import GenerationParams

    params = GenerationParams(max_new_tokens=item.max_new_tokens or max_new_tokens)
    return Submission(item.path, item.prompt or prompt, params=params, metadata=item.metadata)
