"""`wicore make-model`: checkpoint directories built here (no hub)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer

from wicore.cli.common import console, friendly_errors
from wicore.cli.failures import DebugOption
from wicore.cli.logs import quiet_progress_bars


class Preset(str, Enum):
    tiny = "tiny"
    tiny_text = "tiny-text"
    gemma3_4b = "gemma3-4b"
    gemma3_12b = "gemma3-12b"
    gemma3_27b = "gemma3-27b"


@friendly_errors
def make_model(
    preset: Preset = typer.Argument(
        ...,
        help="tiny: a complete toy checkpoint; tiny-text: its text half alone (Gemma3ForCausalLM, the 1B's "
        "architecture: no vision tower); gemma3-4b, gemma3-12b, gemma3-27b: the real config only (weights "
        "seeded at load; runs with --allow-random-weights).",
    ),
    out_dir: Path = typer.Argument(..., help="Directory to write."),
    seed: int = typer.Option(0, help="Weight seed."),
    weights: bool = typer.Option(
        False,
        "--weights",
        help="gemma3-*: also write the seeded weights as bf16 safetensors shards (drawn on the CPU; minutes for "
        "27B), a checkpoint read from disk as a user's is: time to ready from disk.",
    ),
    debug: bool = DebugOption,
) -> None:
    """Write a Gemma-3 checkpoint directory that loads offline like a user's own."""
    if not sys.stderr.isatty():
        quiet_progress_bars()  # transformers' shard-writing bar is noise in a log
    from wicore.models.gemma3 import make_seeded, make_tiny, make_tiny_text

    if preset is Preset.tiny:
        path = make_tiny(out_dir, seed=seed)
    elif preset is Preset.tiny_text:
        path = make_tiny_text(out_dir, seed=seed)
    else:
        path = make_seeded(out_dir, preset.value, seed=seed, weights=weights)
    console.print(f"wrote {preset.value} to {path}")
