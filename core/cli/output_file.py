"""The JSONL file `wicore caption` appends result lines to: which inputs already have their
answer, and clearing the error lines of inputs a rerun tries again (so each input keeps one
line)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Every line that is a JSON object with an `input`; a torn last line (a crash) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("input"), str):
            records.append(record)
    return records


def settled_inputs(records: list[dict], skip_errors: bool) -> set[str]:
    """Inputs not to run again: those with a caption, and with `skip_errors` those with an error."""
    return {r["input"] for r in records if skip_errors or r.get("error") is None}


def drop_inputs(path: Path, inputs: set[str]) -> None:
    """Rewrite `path` without the lines of `inputs`, atomically (a crash leaves the old file)."""
    keep = [r for r in read_records(path) if r["input"] not in inputs]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as sink:
        sink.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in keep)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, path)
