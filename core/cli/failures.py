"""How a failure reaches the user: one line on stderr saying what is wrong and what to do, and an
exit code per kind of failure (each verb's --help lists its codes). `--debug` or
WICORE_LOG_LEVEL=debug adds the traceback above that line. Credentials never appear: every line
and traceback goes through `redact`."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable
from enum import IntEnum
from functools import wraps

import typer

from wicore.errors import ConfigError, RedisUnavailable, WicoreError
from wicore.redaction import redact


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # some jobs or inputs failed (or were canceled); their lines say why
    USAGE = 2  # a flag, argument, setting, input path or model directory is wrong, an extra is missing, or
    # `caption`'s output file is being written by another run
    UNFINISHED = 3  # `result`: some jobs had not ended when --wait ran out
    REDIS = 4  # Redis is unreachable, refuses the credentials, or refuses writes
    WORKERS = 5  # `caption`: the worker processes exited before the work was done
    INTERNAL = 70  # a bug in wicore (EX_SOFTWARE): rerun with --debug and report the traceback
    INTERRUPTED = 130  # 128 + the signal: 130 for SIGINT (Ctrl-C), 143 for SIGTERM


EXIT_MEANING = {
    ExitCode.OK: "success",
    ExitCode.FAILED: "some jobs or inputs failed or were canceled (their lines say why)",
    ExitCode.USAGE: "bad flag, argument, setting, path, port or model directory, or a missing extra (pip install)",
    ExitCode.UNFINISHED: "some jobs had not ended when --wait ran out",
    ExitCode.REDIS: "Redis unreachable, refused the credentials, or refuses writes",
    ExitCode.WORKERS: "the worker processes exited before the work was done",
    ExitCode.INTERNAL: "a bug in wicore (rerun with --debug for the traceback)",
    ExitCode.INTERRUPTED: "stopped by a signal (130 SIGINT, 143 SIGTERM)",
}


def exit_codes_help(*codes: ExitCode) -> str:
    """The `--help` epilog of a verb: the exit codes it can end with."""
    chosen = sorted({ExitCode.OK, *codes, ExitCode.INTERNAL})
    return "Exit codes: " + "; ".join(f"{int(code)} {EXIT_MEANING[code]}" for code in chosen) + "."


class Interrupted(BaseException):
    """SIGTERM or SIGHUP turned into an exception, so that every `with` block unwinds (children
    stopped, files closed) as it does for Ctrl-C. A BaseException: `except Exception` cannot
    swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def one_line(text: str) -> str:
    return redact(" ".join(str(text).split()))


def config_message(exc: ConfigError) -> str:
    """pydantic's multi-line report (with its documentation URL and the offending values, which
    may be secrets) as one line: 'setting: problem; setting: problem'."""
    from pydantic import ValidationError

    cause = exc.__cause__
    if not isinstance(cause, ValidationError):
        return str(exc)
    problems = "; ".join(_problem(error) for error in cause.errors())
    return f"bad configuration: {problems} (check the flags, WICORE_* variables and the config file)"


def _problem(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "settings"
    return f"{where}: {'unknown setting' if error['type'] == 'extra_forbidden' else error['msg']}"


# Import names that differ from the name pip installs them by.
_DISTRIBUTION_OF_MODULE = {
    "PIL": "pillow",
    "multipart": "python-multipart",
    "cudnn": "nvidia-cudnn-frontend",
    "cuda": "cuda-bindings",
    "yaml": "pyyaml",
}
_EXTRA_REQUIREMENT = re.compile(r'\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;.*\bextra\s*==\s*"([^"]+)"')


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_for(module: str) -> str | None:
    """The extra of wicore's (pyproject's optional-dependencies, as the installed metadata lists
    them) whose packages include the one `module` is imported from: 'bench' for matplotlib,
    'worker' for torch or PIL; an extra other than `test` where there is one; None if none does."""
    from importlib import metadata

    top = module.split(".")[0]
    wanted = _normalized(_DISTRIBUTION_OF_MODULE.get(top, top))
    try:
        requirements = metadata.requires("wicore") or []
    except metadata.PackageNotFoundError:
        return None
    extras = [m[2] for m in map(_EXTRA_REQUIREMENT.match, requirements) if m and _normalized(m[1]) == wanted]
    return next((e for e in extras if e != "test"), extras[0] if extras else None)


def _installed(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, extra: str | None = None) -> None:
    """Fail now, in the one line that names the extra to install, when the top-level `module` is
    not installed: before a long run, not at its end. `extra`: the one to name where several
    extras install the module (s3fs: `urls` for image URLs, `datasets` for dataset inputs)."""
    if _installed(module):
        return
    if extra is not None:
        from wicore.errors import ConfigError

        raise ConfigError(f"{module} is not installed: pip install 'wicore[{extra}]'")
    raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The line for a missing top-level module that an extra of ours installs, else None (a
    module missing inside an installed package is a bug, not a missing extra)."""
    top = (exc.name or "").split(".")[0]
    if not top or _installed(top):
        return None
    extra = extra_for(top)
    name = f"{top} ({_DISTRIBUTION_OF_MODULE[top]})" if top in _DISTRIBUTION_OF_MODULE else top
    return f"{name} is not installed: pip install 'wicore[{extra}]'" if extra else None


def describe(exc: BaseException) -> tuple[ExitCode | int, str]:
    """(exit code, the line to print) for any exception that ends a verb."""
    from redis.exceptions import RedisError

    if isinstance(exc, Interrupted):
        return 128 + exc.signum, f"stopped by {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED, "stopped by SIGINT"
    if isinstance(exc, ConfigError):
        return ExitCode.USAGE, config_message(exc)
    if isinstance(exc, RedisUnavailable):
        return ExitCode.REDIS, str(exc)
    if isinstance(exc, RedisError):
        return ExitCode.REDIS, f"Redis failed: {exc} (is it still up? check --redis-url / WICORE_REDIS_URL)"
    if isinstance(exc, WicoreError):
        return getattr(exc, "exit_code", ExitCode.FAILED), str(exc)
    if isinstance(exc, ModuleNotFoundError) and (line := _missing_extra(exc)):
        return ExitCode.USAGE, line
    if isinstance(exc, OSError) and exc.filename is not None:
        return ExitCode.FAILED, f"{exc.filename}: {exc.strerror or exc}"
    return ExitCode.INTERNAL, f"unexpected {type(exc).__name__}: {exc} (a bug: rerun with --debug for the traceback)"


def debugging() -> bool:
    return os.environ.get("WICORE_LOG_LEVEL", "").lower() == "debug" or logging.getLogger().isEnabledFor(logging.DEBUG)


def report(exc: BaseException, debug: bool = False) -> int:
    """Print `exc` as one line (after its traceback when debugging); return the exit code.
    Notes added on the way out (`exc.add_note`) join the line."""
    code, message = describe(exc)
    message = "; ".join([message, *getattr(exc, "__notes__", [])])
    if debug or debugging():
        sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()
    return int(code)


def friendly_errors(command: Callable) -> Callable:
    """Every failure of `command` ends as one line and an exit code, never a bare traceback."""

    @wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (the top of a verb: every failure becomes one line)
            raise typer.Exit(report(exc, bool(kwargs.get("debug")))) from None

    return wrapper


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def raise_on_signals(*signums: int) -> None:
    """Turn these signals into `Interrupted` in the main thread."""

    def handler(signum, frame):
        raise Interrupted(signum)

    for signum in signums:
        signal.signal(signum, handler)


def hold_signals() -> None:
    """While a verb stops its children: further stop signals are ignored, so the cleanup (bounded
    in time) always runs to its end."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


DebugOption = typer.Option(False, "--debug", help="On failure, print the traceback too (or WICORE_LOG_LEVEL=debug).")


def debug_level(debug: bool) -> str | None:
    """The log level `--debug` asks for (None: as configured)."""
    return "debug" if debug else None
