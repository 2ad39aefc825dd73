"""Logging for every verb: plain lines on stderr (no colour codes, no wrapping), credentials
redacted, third-party progress bars off where the output is a log rather than a terminal."""

from __future__ import annotations

import logging
import os
import sys

from wicore.redaction import redact

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RedactingFormatter(logging.Formatter):
    """A password in a URL never reaches a log line or a logged traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def level_or(settings, default: str) -> str:
    """The configured log level, or `default` when none was set (flag, environment or file)."""
    return settings.log_level if "log_level" in settings.model_fields_set else default


def quiet_progress_bars() -> None:
    """tqdm bars (transformers' weight loading, hub downloads) would land in a worker's log as
    hundreds of carriage-return lines: off, before those libraries are imported."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("NO_COLOR", "1")
