"""`wicore <verb>`: the command line is the contract other tools build on."""

from __future__ import annotations

import sys

import typer

from wicore.cli import batches, bench, caption, daemons, formats, gateway, jobs, models
from wicore.cli.failures import ExitCode, exit_codes_help, report

try:  # recent typer vendors click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:
    from click.exceptions import NoArgsIsHelpError, UsageError

E = ExitCode
app = typer.Typer(
    name="wicore",
    help="Queue-driven batch inference for multimodal LLMs (RQ on Redis, shape-bucket batching).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command(epilog=exit_codes_help(E.FAILED, E.USAGE, E.REDIS, E.WORKERS, E.INTERRUPTED))(caption.caption)
app.command(epilog=exit_codes_help(E.USAGE, E.REDIS, E.INTERRUPTED))(daemons.worker)
app.command(epilog=exit_codes_help(E.FAILED, E.USAGE, E.REDIS))(jobs.enqueue)
app.command(epilog=exit_codes_help(E.FAILED, E.USAGE, E.UNFINISHED, E.REDIS))(jobs.result)
app.command(epilog=exit_codes_help(E.USAGE, E.REDIS))(jobs.status)
app.command(epilog=exit_codes_help(E.FAILED, E.USAGE, E.REDIS))(gateway.cancel)
app.command(epilog=exit_codes_help(E.USAGE, E.REDIS, E.INTERRUPTED))(gateway.serve)
app.command(epilog=exit_codes_help(E.USAGE, E.REDIS, E.INTERRUPTED))(daemons.dashboard)
app.command("make-model", epilog=exit_codes_help(E.USAGE))(models.make_model)
app.command(epilog=exit_codes_help(E.USAGE))(formats.schema)
app.command("run-batch", epilog=exit_codes_help(E.FAILED, E.USAGE, E.WORKERS, E.INTERRUPTED))(batches.run_batch)
app.add_typer(batches.app, name="batch", epilog=exit_codes_help(E.FAILED, E.USAGE, E.UNFINISHED))
app.add_typer(bench.app, name="bench")


def main() -> None:
    """The `wicore` console script: a usage error is one line too (click's default is a box)."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help())
        code = ExitCode.USAGE
    except UsageError as exc:
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        sys.stderr.write(f"error: {exc.format_message()}{where}\n")
        code = ExitCode.USAGE
    except typer.Abort:
        code = ExitCode.INTERRUPTED
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 (a verb without its own handler: still one line)
        code = report(exc)
    sys.exit(int(code or 0))


if __name__ == "__main__":
    main()
