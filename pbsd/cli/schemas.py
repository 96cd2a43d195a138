"""``pbsd schemas``: the wire contracts' JSON Schemas."""

from __future__ import annotations

import typer

app = typer.Typer(help="Wire-contract JSON Schemas.", no_args_is_help=True)


@app.command("export")
def schemas_export() -> None:
    """Write the JSON Schema of every wire contract into proto/schemas/."""
    from proto.schemas_export import export

    for path in export():
        typer.echo(f"wrote {path}")


@app.command("check")
def schemas_check() -> None:
    """Exit 1 when proto/schemas/ differs from the models."""
    from proto.schemas_export import SCHEMA_DIR, render_schemas

    stale = [
        n
        for n, text in render_schemas().items()
        if not (SCHEMA_DIR / n).exists() or (SCHEMA_DIR / n).read_text() != text
    ]
    if stale:
        typer.echo(f"stale schemas: {', '.join(stale)}; run `pbsd schemas export`", err=True)
        raise typer.Exit(1)
    typer.echo("schemas are up to date")
