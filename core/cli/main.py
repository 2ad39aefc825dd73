"""`wicore <verb>`: the command line is the contract other tools build on."""

from __future__ import annotations

import typer

from wicore.cli import bench, caption, daemons, gateway, jobs, models

app = typer.Typer(
    name="wicore",
    help="Queue-driven batch inference for multimodal LLMs (RQ on Redis, shape-bucket batching).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(caption.caption)
app.command()(daemons.worker)
app.command()(jobs.enqueue)
app.command()(jobs.result)
app.command()(jobs.status)
app.command()(gateway.cancel)
app.command()(gateway.serve)
app.command()(daemons.dashboard)
app.command("make-model")(models.make_model)
app.add_typer(bench.app, name="bench")

if __name__ == "__main__":
    app()
