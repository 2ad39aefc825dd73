"""`wicore schema manifest|result`: the JSON Schemas of wicore's file formats, generated from
their pydantic models (core/schemas/manifest.py, core/schemas/results.py) and shipped as
core/json_schemas/*.schema.json (a test keeps the shipped files equal to the models)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer

from wicore.cli.common import friendly_errors
from wicore.cli.failures import DebugOption
from wicore.schemas import ManifestEntry, ResultLine

SHIPPED = Path(__file__).resolve().parents[1] / "json_schemas"


class Format(str, Enum):
    manifest = "manifest"
    result = "result"


MODELS = {Format.manifest: ManifestEntry, Format.result: ResultLine}


def schema_text(fmt: Format) -> str:
    return json.dumps(MODELS[fmt].model_json_schema(), indent=2, ensure_ascii=False) + "\n"


def shipped_path(fmt: Format) -> Path:
    return SHIPPED / f"{fmt.value}.schema.json"


@friendly_errors
def schema(
    fmt: Format = typer.Argument(
        ..., metavar="manifest|result", help="manifest: a JSONL input line; result: a result line."
    ),
    debug: bool = DebugOption,
) -> None:
    """Print the JSON Schema of a manifest line (`caption` / `enqueue` input) or of a result line
    (`caption` output, `result` output)."""
    typer.echo(schema_text(fmt), nl=False)
