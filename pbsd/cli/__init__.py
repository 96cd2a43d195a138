"""The ``pbsd`` command line: one module per command group, each thin over the code it calls.

Subcommands import their service lazily so that ``pbsd --help`` stays fast and never loads
torch. Every command runs inside :class:`pbsd.cli.errors.Group`: a user's error (a bad path or
file, a service that does not answer, a missing token) is one line, never a traceback.
"""

from __future__ import annotations

import typer

from pbsd.cli import compare, demo, evaluate, model, runs, schemas, serve, teacher, world
from pbsd.cli.errors import Group

__all__ = ["app"]

app = typer.Typer(
    cls=Group,
    help="pbsd: RL for long-horizon search agents with PBSD turn-level credit.",
    no_args_is_help=True,
)
app.add_typer(schemas.app, name="schemas")
app.add_typer(world.app, name="world")
app.add_typer(serve.app, name="serve")
app.add_typer(model.app, name="model")
app.add_typer(runs.app, name="runs")
app.add_typer(teacher.app, name="teacher")
app.command("sft")(model.sft_cmd)
app.command("demo")(demo.demo_cmd)
app.command("compare")(compare.compare_cmd)
app.command("eval")(evaluate.eval_cmd)


@app.command()
def version() -> None:
    """Print the installed version."""
    from pbsd import __version__

    typer.echo(__version__)
