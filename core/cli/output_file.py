"""The file `wicore caption` writes its result lines to: JSONL (one `ResultLine` per line) or
Parquet (`-o out.parquet`: one row per line, the same columns). Which inputs already have their
answer; lines appended as results land; each input keeps one line, its newest; one run per file
at a time (`run_lock`: an flock on OUT.lock, naming the run that holds it).

Reading and writing stream: a JSONL file line by line, a Parquet file row group by row group.
A Parquet file is whole only once closed (its footer), so a run writes OUT.parquet.partial and
puts it in place when it ends (done, an error or a signal); a run killed with SIGKILL loses its
own new rows only, never those of earlier runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from wicore.errors import ConfigError
from wicore.schemas import ResultLine

PARQUET_SUFFIX = ".parquet"
ROW_GROUP = 256  # Parquet rows buffered before they are written as one row group


class OutputBusy(ConfigError):
    """Another run holds the output file."""


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == PARQUET_SUFFIX


# -- one run per file ---------------------------------------------------------------------------


@contextlib.contextmanager
def run_lock(output: Path) -> Iterator[None]:
    """Hold OUT.lock (an flock, released by the kernel however this process ends) for the run;
    raise OutputBusy at once, naming the holder, when another run has it."""
    lock = output.with_name(output.name + ".lock")
    fd = _locked(lock, output)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, this_run().encode())
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still held: a run waiting on this inode finds it gone and retries
        os.close(fd)


def this_run() -> str:
    """'pid 4242 on gpu-7 since 2026-01-01 12:00:00 +0000': what a refused run is told."""
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %z')}"


def _locked(lock: Path, output: Path) -> int:
    """An open descriptor of `lock` holding its flock; retried when the file was replaced between
    the open and the lock (its last holder removed it)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "a run starting up"
            os.close(fd)
            raise OutputBusy(
                f"{output} is being written by another run ({holder}; lock {lock}): wait for it to end, or write "
                f"to another -o file"
            ) from None
        if _same_file(fd, lock):
            return fd
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


# -- what is already answered -------------------------------------------------------------------


@dataclass
class Answers:
    """What OUT holds: {input: whether its newest line has a caption (no error)}, and how many
    lines (more lines than inputs: a run was killed before dropping the older ones)."""

    ok: dict[str, bool] = field(default_factory=dict)
    lines: int = 0

    def settled(self, skip_errors: bool) -> set[str]:
        """Inputs not to run again: those with a caption, and with `skip_errors` those with an error."""
        return {input for input, ok in self.ok.items() if ok or skip_errors}

    @property
    def duplicated(self) -> bool:
        return self.lines > len(self.ok)


def read_answers(path: Path) -> Answers:
    if is_parquet(path):
        from wicore.cli.failures import require

        require("pyarrow")  # before the run, not when its first result is written
    answers = Answers()
    for input, error in _keys_and_errors(path):
        answers.ok[input] = error is None
        answers.lines += 1
    return answers


def _keys_and_errors(path: Path) -> Iterator[tuple[str, str | None]]:
    if not path.exists():
        return
    records = _parquet_records(path, ["input", "error"]) if is_parquet(path) else _jsonl_records(path)
    for record in records:
        if isinstance(record.get("input"), str):
            yield record["input"], record.get("error")


def _jsonl_records(path: Path) -> Iterator[dict]:
    """Every line that is a JSON object; a torn last line (a crash) is skipped."""
    with path.open() as source:
        for line in source:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def _parquet_records(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    for batch in _parquet_batches(path, columns):
        yield from batch.to_pylist()


def _parquet_batches(path: Path, columns: list[str] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(path)
        missing = set(columns or RESULT_COLUMNS) - set(source.schema_arrow.names)
        if missing:
            raise ConfigError(f"{path}: not a wicore output file (no column {', '.join(sorted(missing))})")
        yield from source.iter_batches(batch_size=ROW_GROUP, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path}: not a readable Parquet file ({exc}); move it away or choose another -o") from exc


# -- writing ------------------------------------------------------------------------------------


class JsonlSink:
    """Appends each line (flushed: a crash leaves every line written before it). On close, older
    lines of the inputs written again are dropped, so each input ends with one line."""

    def __init__(self, path: Path, answers: Answers):
        self.path = path
        self.superseded = set(answers.ok)  # inputs with an older line in the file
        self.rewritten: set[str] = set()
        self.duplicated = answers.duplicated
        self.sink = path.open("a")
        if not ends_a_line(path):  # a torn last line (a crash): the next line starts on a line of its own
            self.sink.write("\n")

    def write(self, line: ResultLine) -> None:
        self.sink.write(line.model_dump_json() + "\n")
        self.sink.flush()
        if line.input in self.superseded:
            self.rewritten.add(line.input)

    def close(self) -> None:
        self.sink.close()
        if self.rewritten or self.duplicated:
            keep_newest_lines(self.path)


def ends_a_line(path: Path) -> bool:
    """Whether the file is empty or ends with a newline."""
    with path.open("rb") as source:
        if source.seek(0, os.SEEK_END) == 0:
            return True
        source.seek(-1, os.SEEK_END)
        return source.read(1) == b"\n"


def keep_newest_lines(path: Path) -> None:
    """Rewrite `path` with only the newest line of each input, atomically (a crash leaves the
    old file). Two passes over the file: memory holds line numbers, never lines."""
    newest: dict[str, int] = {}
    with path.open() as source:
        for number, line in enumerate(source):
            newest[_input_of(line) or f"\0{number}"] = number
    keep = set(newest.values())
    tmp = path.with_name(path.name + ".tmp")
    with path.open() as source, tmp.open("w") as sink:
        sink.writelines(line for number, line in enumerate(source) if number in keep and _input_of(line))
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, path)


def _input_of(line: str) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    input = record.get("input") if isinstance(record, dict) else None
    return input if isinstance(input, str) else None


RESULT_COLUMNS = list(ResultLine.model_fields)
JSON_COLUMNS = ("timings", "logprobs", "choices")  # nested values, as JSON strings (null when empty)


def result_schema():
    """The Parquet columns: ResultLine's fields; the nested ones (`timings`, whose keys vary by
    engine; `logprobs` and `choices`) as JSON strings."""
    import pyarrow as pa

    ints = {"prompt_tokens", "output_tokens"}
    return pa.schema([(name, pa.int64() if name in ints else pa.string()) for name in RESULT_COLUMNS])


def parquet_row(line: ResultLine) -> dict:
    row = line.model_dump(mode="json")
    for name in JSON_COLUMNS:
        row[name] = json.dumps(row[name]) if row[name] else None
    return row


class ParquetSink:
    """Rows buffered into row groups of ROW_GROUP, written to OUT.parquet.partial as results land.
    On close, the rows of the existing OUT not written again follow, and the file takes OUT's
    place."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self.schema = result_schema()
        self.writer = pq.ParquetWriter(self.partial, self.schema)
        self.rows: list[dict] = []
        self.written: set[str] = set()

    def write(self, line: ResultLine) -> None:
        self.rows.append(parquet_row(line))
        if line.input is not None:
            self.written.add(line.input)
        if len(self.rows) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def close(self) -> None:
        import pyarrow as pa

        self._flush()
        if self.path.exists():
            written = pa.array(list(self.written), pa.string())
            for batch in _parquet_batches(self.path):
                self._write_kept(batch, written)
        self.writer.close()
        os.replace(self.partial, self.path)

    def _write_kept(self, batch, written) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        table = pa.Table.from_batches([batch]).select(RESULT_COLUMNS).cast(self.schema)
        kept = table.filter(pc.invert(pc.is_in(table["input"], value_set=written)))
        if kept.num_rows:
            self.writer.write_table(kept)


def open_sink(path: Path, answers: Answers) -> JsonlSink | ParquetSink:
    """The writer for OUT by its suffix (`.parquet`, else JSONL)."""
    if is_parquet(path):
        return ParquetSink(path)
    return JsonlSink(path, answers)
