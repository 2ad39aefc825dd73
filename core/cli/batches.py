"""`wicore batch submit|status|wait|download|cancel`: OpenAI's Batch API of a running gateway,
from a shell (over HTTP); and `wicore run-batch IN.jsonl -o OUT.jsonl`: the same batch offline,
on an embedded Redis and workers of its own (as `vllm run-batch`). OpenAI's line formats in and
out: `{custom_id, method, url, body}` lines in, `{id, custom_id, response, error}` lines out."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import typer

from wicore.cli.common import (
    BatchSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    EngineOption,
    ModelIdOption,
    ModelOption,
    checked_model,
    console,
    friendly_errors,
    settings_from,
)
from wicore.cli.failures import DebugOption, ExitCode, debug_level, raise_on_signals, require
from wicore.errors import ConfigError, WicoreError

app = typer.Typer(help="OpenAI batches on a running gateway (`wicore serve`), over its HTTP API.", no_args_is_help=True)

BaseUrlOption = typer.Option(
    "http://127.0.0.1:8000/v1",
    "--base-url",
    envvar="OPENAI_BASE_URL",
    help="The gateway's /v1 URL (also OPENAI_BASE_URL).",
)
ApiKeyOption = typer.Option(
    None,
    "--api-key",
    envvar="OPENAI_API_KEY",
    help="Bearer key, when the gateway wants one (also OPENAI_API_KEY).",
    show_default=False,
)
ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


class GatewayFailed(WicoreError):
    """The gateway refused a call (its message says why) or could not be reached."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = exit_code


class Api:
    """The few calls the verbs make, with the gateway's error message as the failure."""

    def __init__(self, base_url: str, api_key: str | None):
        require("httpx")
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60)

    def call(self, method: str, path: str, **kwargs) -> Any:
        import httpx

        try:
            reply = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayFailed(
                f"{self.client.base_url}{path}: {exc} (is `wicore serve` up? check --base-url)"
            ) from None
        if reply.status_code >= 400:
            code = ExitCode.USAGE if reply.status_code < 500 else ExitCode.FAILED
            raise GatewayFailed(f"{method} {path}: {reply.status_code} {error_message(reply)}", code)
        return reply.json()

    def download(self, file_id: str, sink) -> None:
        with self.client.stream("GET", f"/files/{file_id}/content") as reply:
            if reply.status_code >= 400:
                raise GatewayFailed(f"GET /files/{file_id}/content: {reply.status_code}")
            for piece in reply.iter_bytes():
                sink.write(piece)


def error_message(reply) -> str:
    try:
        return reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]


def echo(batch: dict) -> None:
    typer.echo(json.dumps(batch))


def parse_metadata(pairs: list[str] | None) -> dict[str, str] | None:
    found = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--metadata wants KEY=VALUE, got {pair!r}")
        found[key] = value
    return found or None


@app.command()
@friendly_errors
def submit(
    input_file: Path = typer.Argument(..., help="JSONL of OpenAI batch lines."),
    metadata: list[str] = typer.Option(None, help="KEY=VALUE kept with the batch (repeatable)."),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    debug: bool = DebugOption,
) -> None:
    """Upload IN.jsonl and start a batch on it; prints the batch (one JSON line: its id, status)."""
    if not input_file.is_file():
        raise ConfigError(f"{input_file}: no such file")
    api = Api(base_url, api_key)
    with input_file.open("rb") as data:
        uploaded = api.call("POST", "/files", files={"file": (input_file.name, data)}, data={"purpose": "batch"})
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    echo(api.call("POST", "/batches", json={**body, "metadata": parse_metadata(metadata)}))


@app.command()
@friendly_errors
def status(
    batch_id: str = typer.Argument(...),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    debug: bool = DebugOption,
) -> None:
    """The batch as the gateway has it (one JSON line: status, request_counts, file ids)."""
    echo(Api(base_url, api_key).call("GET", f"/batches/{batch_id}"))


@app.command()
@friendly_errors
def wait(
    batch_id: str = typer.Argument(...),
    timeout: float = typer.Option(None, min=0, help="Give up after this many seconds (exit 3)."),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    debug: bool = DebugOption,
) -> None:
    """Until the batch ends; prints it. Exit 0 when completed, 1 when failed, expired or cancelled."""
    api, deadline = Api(base_url, api_key), None if timeout is None else time.monotonic() + timeout
    while (batch := api.call("GET", f"/batches/{batch_id}"))["status"] not in ENDED:
        if deadline is not None and time.monotonic() >= deadline:
            echo(batch)
            raise typer.Exit(ExitCode.UNFINISHED)
        time.sleep(POLL_S)
    echo(batch)
    if batch["status"] != "completed":
        raise typer.Exit(ExitCode.FAILED)


@app.command()
@friendly_errors
def download(
    batch_id: str = typer.Argument(...),
    output: Path = typer.Option(..., "-o", "--output", help="File for the answered lines (and the errors)."),
    errors: Path = typer.Option(None, help="A separate file for the error lines (default: into --output)."),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    debug: bool = DebugOption,
) -> None:
    """The batch's output and error files, streamed to disk."""
    api = Api(base_url, api_key)
    batch = api.call("GET", f"/batches/{batch_id}")
    if batch["status"] not in ENDED:
        raise GatewayFailed(
            f"batch {batch_id} is {batch['status']}; `wicore batch wait {batch_id}` first", ExitCode.UNFINISHED
        )
    with output.open("wb") as sink:
        if batch["output_file_id"]:
            api.download(batch["output_file_id"], sink)
        if batch["error_file_id"] and errors is None:
            api.download(batch["error_file_id"], sink)
    if errors is not None:
        with errors.open("wb") as sink:
            if batch["error_file_id"]:
                api.download(batch["error_file_id"], sink)
    counts = batch["request_counts"]
    console.print(f"{counts['completed']} answered, {counts['failed']} errors -> {output}", markup=False)


@app.command()
@friendly_errors
def cancel(
    batch_id: str = typer.Argument(...),
    base_url: str = BaseUrlOption,
    api_key: str = ApiKeyOption,
    debug: bool = DebugOption,
) -> None:
    """Cancel: queued lines never run, running ones finish; prints the batch (cancelling)."""
    echo(Api(base_url, api_key).call("POST", f"/batches/{batch_id}/cancel"))


@friendly_errors
def run_batch(
    input_file: Path = typer.Argument(..., help="JSONL of OpenAI batch lines (image paths, data URIs)."),
    output: Path = typer.Option(..., "-o", "--output", help="JSONL of one result line per input line."),
    model: Path = ModelOption,
    model_id: str = ModelIdOption,
    engine: str = typer.Option(None, help="reference | fast | null (default: auto: fast on CUDA)", show_default=False),
    workers: int = typer.Option(1, min=1, help="Worker processes to start (each loads the model)."),
    batch_size: int = BatchSizeOption,
    device: str = DeviceOption,
    dtype: str = DtypeOption,
    engine_option: list[str] = EngineOption,
    allow_root: list[Path] = typer.Option(None, help="Folder image paths may point into (repeatable) [/]."),
    config: Path = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Run a batch file offline: an embedded Redis, workers of its own, OpenAI's line formats in
    and out (answers first, then errors). Exit 1 when any line ended in an error."""
    require("fastapi")  # the batch runner lives with the gateway
    raise_on_signals(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    if not input_file.is_file():
        raise ConfigError(f"{input_file}: no such file")
    if not output.parent.is_dir():
        raise ConfigError(f"-o {output}: the folder {output.parent} does not exist")
    settings = settings_from(
        config, engine_option=engine_option, model=model, model_id=model_id, engine=engine, device=device,
        dtype=dtype, batch_size=batch_size, allowed_roots=allow_root or [Path("/")], log_level=debug_level(debug),
    )  # fmt: skip
    model_dir, served_id = checked_model(settings, False)
    batch = offline_batch(settings, model_dir, served_id, input_file, output, workers)
    counts = batch.request_counts
    console.print(
        f"{counts.completed} answered, {counts.failed} errors of {counts.total} lines -> {output}", markup=False
    )
    if counts.failed:
        raise typer.Exit(ExitCode.FAILED)


def offline_batch(settings, model_dir: Path, model_id: str, input_file: Path, output: Path, workers: int):
    """The batch run to its end on an embedded Redis; its files written into `output`."""
    import tempfile

    from wicore.cli.pool import WorkerPool
    from wicore.cli.process_group import ProcessGroup
    from wicore.cli.worker_specs import plan_workers
    from wicore.embedded import EmbeddedRedis

    group = ProcessGroup()
    with contextlib.ExitStack() as stack:
        stack.callback(group.kill)
        url = stack.enter_context(EmbeddedRedis(spawn=group.popen)).url
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wicore-batch-")))
        served = settings.model_copy(update={"redis_url": url, "model": model_dir, "model_id": model_id})
        pool = stack.enter_context(
            WorkerPool(plan_workers("run-batch", served, gpus=None, workers=workers), served, [], group, folder)
        )
        return run_offline(served, folder, input_file, output, pool)


def run_offline(settings, folder: Path, input_file: Path, output: Path, pool):
    from redis import Redis

    from wicore.gateway.batch_driver import BatchSettings
    from wicore.gateway.batch_runner import BatchRunner
    from wicore.gateway.batch_shapes import Batch, BatchStatus, FileObject, RequestCounts
    from wicore.gateway.batch_state import BatchRecords, FileRecords, new_id
    from wicore.gateway.file_store import FolderStore
    from wicore.producer import ProducerConfig

    connection = Redis.from_url(settings.redis_url)
    store = FolderStore(folder / "files", max_bytes=2**62)
    file_id, now = new_id("file"), int(time.time())
    with input_file.open("rb") as source:
        while piece := source.read(1 << 20):
            store.append(file_id, piece)
    FileRecords(connection).save(
        FileObject(id=file_id, bytes=store.size(file_id), created_at=now, filename=input_file.name, purpose="batch")
    )
    batch = Batch(
        id=new_id("batch"), endpoint="/v1/chat/completions", input_file_id=file_id, completion_window="24h",
        status=BatchStatus.VALIDATING, created_at=now, expires_at=now + 10 * 365 * 86_400, request_counts=RequestCounts(),
    )  # fmt: skip
    records = BatchRecords(connection)
    records.create(batch, store.name)
    producer = ProducerConfig(by_path=True, result_ttl_s=settings.result_ttl_s, retries=settings.retries)
    runner = BatchRunner(connection, store, BatchSettings(settings.model_id, tuple(settings.allowed_roots), producer))
    while (record := records.get(batch.id)) is not None and not record.batch.status.ended:
        if not runner.turn():
            pool.check()
            time.sleep(runner.settings.idle_s)
    if record is None:
        raise WicoreError(f"batch {batch.id} left the embedded Redis before it ended")
    with output.open("wb") as sink:
        for file_id in (record.out_file, record.err_file):
            for piece in store.chunks(file_id):
                sink.write(piece)
    return record.batch
