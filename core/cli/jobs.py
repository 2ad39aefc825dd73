"""`wicore enqueue`, `wicore result`, `wicore status`: the verbs of a service that only submits.
They import neither torch nor transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from redis import Redis
from rich.table import Table

from wicore.cli.common import ConfigOption, ModelIdOption, RedisOption, console, friendly_errors, settings_from
from wicore.cli.input_paths import expand_inputs
from wicore.errors import ConfigError, JobFailed, ResultTimeout
from wicore.schemas import GenerationParams, Lane

EXIT_FAILED, EXIT_UNFINISHED = 1, 3


def _redis(settings) -> Redis:
    if not settings.redis_url:
        raise ConfigError("needs --redis-url or WICORE_REDIS_URL")
    return Redis.from_url(settings.redis_url)


def _model_id(settings) -> str:
    if settings.model_id:
        return settings.model_id
    if settings.model is not None:
        from wicore.cli.common import model_id_of

        return model_id_of(settings.model)
    from wicore.models import TINY_ID

    return TINY_ID


@friendly_errors
def enqueue(
    inputs: list[str] = typer.Argument(..., help="Image files, folders (recursive) or JSONL manifests."),
    redis_url: str = RedisOption,
    model_id: str = ModelIdOption,
    model: Path = typer.Option(None, help="Checkpoint dir (only its name is used, as the model id)."),
    prompt: str = typer.Option(None, help="Prompt (default: 'Describe this image in detail.')."),
    max_new_tokens: int = typer.Option(64, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(None, help="Sampling seed."),
    priority: Lane = typer.Option(Lane.NORMAL, help="Lane: high jobs are taken first."),
    deadline_s: float = typer.Option(None, help="Fail jobs not started within this many seconds."),
    by_path: bool = typer.Option(False, help="Send file paths (workers must see them) instead of image bytes."),
    config: Path = ConfigOption,
) -> None:
    """Submit images as caption jobs; print one job id per image (same work = same id)."""
    from wicore.producer import Producer, ProducerConfig, Submission

    settings = settings_from(config, redis_url=redis_url, model_id=model_id, model=model)
    producer = Producer(
        _redis(settings),
        model=_model_id(settings),
        config=ProducerConfig(by_path=by_path, result_ttl_s=settings.result_ttl_s, retries=settings.retries),
    )
    deadline = time.time() + deadline_s if deadline_s is not None else None
    items = list(expand_inputs(inputs))
    for item in items:
        if item.error:
            console.print(f"[yellow]skipped[/yellow] {item.error}")
    good = [item for item in items if not item.error]
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    submissions = [
        Submission(
            item.path,
            item.prompt or prompt,
            params=params.model_copy(update={"max_new_tokens": item.max_new_tokens or max_new_tokens}),
            priority=priority,
            deadline=deadline,
            metadata=item.metadata,
        )
        for item in good
    ]
    for job_id in producer.submit_many(submissions):
        typer.echo(job_id)


@friendly_errors
def result(
    job_ids: list[str] = typer.Argument(..., help="Job ids printed by `wicore enqueue`."),
    wait: float = typer.Option(0.0, help="Block up to this many seconds for each job to end."),
    redis_url: str = RedisOption,
    config: Path = ConfigOption,
) -> None:
    """Print each job's result as one JSON line, in the order given. Exit 1 if any job failed,
    3 if any has not ended."""
    from wicore.producer import Producer

    settings = settings_from(config, redis_url=redis_url)
    producer = Producer(_redis(settings), model="any")
    code = 0
    for job_id in job_ids:
        try:
            typer.echo(producer.result(job_id, timeout=wait or None).model_dump_json())
        except JobFailed as exc:
            typer.echo(json.dumps({"job_id": job_id, "error": exc.message}))
            code = max(code, EXIT_FAILED)
        except ResultTimeout as exc:
            typer.echo(json.dumps({"job_id": job_id, "error": None, "unfinished": str(exc)}))
            code = EXIT_UNFINISHED
    raise typer.Exit(code)


@friendly_errors
def status(
    redis_url: str = RedisOption,
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
    config: Path = ConfigOption,
) -> None:
    """Queues per shape bucket, workers, and job counts."""
    from wicore.worker.status import collect_status

    settings = settings_from(config, redis_url=redis_url)
    report = collect_status(_redis(settings))
    if as_json:
        typer.echo(json.dumps(report))
        return
    queues = Table("queue (model.lane.crops.prompt.new_tokens)", "queued", "started", "finished", "failed")
    for q in report["queues"]:
        queues.add_row(q["name"], *(str(q[k]) for k in ("queued", "started", "finished", "failed")))
    workers = Table("worker", "state", "running", "ok", "failed", "caches and engine counters")
    for w in report["workers"]:
        workers.add_row(w["name"], w["state"], str(w["running"]), str(w["ok"]), str(w["failed"]), w["stats_line"])
    console.print(queues)
    console.print(workers)
