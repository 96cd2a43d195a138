"""``pbsd world``: the embedded search world (graph, corpus, questions, SFT data)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="The embedded search world: knowledge graph, corpus, questions, SFT data.", no_args_is_help=True
)


@app.command("build")
def world_build(
    out: Path = typer.Option(..., "--out", help="directory to write the world into"),
    # the defaults are the demo's world (demo/config.py), the one the committed policy was made for
    seed: int = typer.Option(0, help="same seed and sizes, same bytes"),
    entities: int = typer.Option(2000, help="number of entities in the knowledge graph"),
    questions: int | None = typer.Option(
        None, help="size of the question pool (default: what the splits need + 30%)"
    ),
    rl: int = typer.Option(575, help="questions in the RL split"),
    validation: int = typer.Option(200, help="questions in the validation split"),
    sft: int = typer.Option(6000, help="questions in the SFT split"),
    parquet: bool = typer.Option(False, help="also write Parquet files (needs pyarrow)"),
) -> None:
    """Generate a world: graph, one document per entity, multi-hop questions with unique answers."""
    from worldgen.build import build_world

    result = build_world(
        out,
        seed=seed,
        entities=entities,
        n_rl=rl,
        n_val=validation,
        n_sft=sft,
        questions=questions,
        parquet=parquet,
    )
    sizes = ", ".join(f"{k} {len(v)}" for k, v in result.splits.items())
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    typer.echo(f"wrote {out}: {len(result.graph.entities)} entities, questions: {sizes} ({timing})")


@app.command("demo-questions")
def world_demo_questions(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    out: Path = typer.Option(..., "--out", help="folder to write rl.jsonl and eval.jsonl into"),
    config: Path | None = typer.Option(
        None, help="a YAML or JSON file of demo settings (see demo/config.py); default: the demo's"
    ),
) -> None:
    """Write the question files `pbsd demo` trains and evaluates on (demo/questions.py): the RL
    questions of its difficulties, less the held-out ones in eval.jsonl. The Compose run
    (deploy/runs/demo-cpu.yaml) uses them, so that it measures what the demo measures."""
    from demo.config import DemoConfig
    from demo.questions import question_files

    files = question_files(DemoConfig.load(config), world, out)
    typer.echo(
        f"wrote {files.train} ({files.train_questions} questions) and {files.evaluation} "
        f"({files.evaluation_questions})"
    )


@app.command("fingerprint")
def world_fingerprint_cmd(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    stamp: Path | None = typer.Option(
        None, help="a checkpoint supervised on this world: record the fingerprint in its pbsd.json"
    ),
) -> None:
    """Print the world's fingerprint (SHA-256 over its files' hashes); `pbsd demo` reuses a warm
    policy only when its pbsd.json names the fingerprint of the world the demo builds."""
    import json

    from worldgen.build import world_fingerprint

    manifest = world / "manifest.json"
    if not manifest.exists():
        raise typer.BadParameter(f"{manifest} not found: not a world", param_hint="--world")
    fingerprint = world_fingerprint(json.loads(manifest.read_text()))
    if stamp is not None:
        from services.model.checkpoint import stamp_world

        stamp_world(stamp, fingerprint)
    typer.echo(fingerprint)


@app.command("sft-data")
def world_sft_data(
    world: Path = typer.Option(..., "--world", help="a directory written by `pbsd world build`"),
    out: Path = typer.Option(..., "--out", help="JSONL file of chat trajectories to write"),
    split: str = typer.Option("sft", help="which question split to solve"),
    limit: int | None = typer.Option(None, help="solve only the first N questions"),
    seed: int = typer.Option(0),
    detour_rate: float = typer.Option(
        0.25, help="chance of a detour (vague search, wrong page, re-check) at each step"
    ),
    search_num: int = typer.Option(5, help="results the oracle asks of each search"),
    rename: float = typer.Option(
        0.0,
        help="fraction of trajectories whose invented names are renamed consistently "
        "(fresh per trajectory), so they can only be fitted by copying (worldgen/rename.py)",
    ),
) -> None:
    """Write oracle trajectories (the scripted expert using the offline tools) for the SFT warm start."""
    from worldgen.oracle import write_sft_data

    stats = write_sft_data(
        world,
        out,
        split=split,
        limit=limit,
        seed=seed,
        detour_rate=detour_rate,
        search_num=search_num,
        rename=rename,
    )
    typer.echo(
        f"wrote {stats['written']} trajectories to {out} ({stats['skipped']} questions skipped, "
        f"{stats['tool_calls']} tool calls, {stats['detours']} detours, {stats['renamed']} renamed)"
    )
