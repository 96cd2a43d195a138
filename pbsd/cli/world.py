"""``pbsd world``: the embedded search world (graph, corpus, questions, SFT data)."""

from __future__ import annotations

from pathlib import Path

import typer

from pbsd.cli.errors import UserError
from pbsd.cli.inputs import checkpoint_dir, demo_settings, output_file, share, world_dir

app = typer.Typer(help="The embedded search world: graph, corpus, questions, SFT data.", no_args_is_help=True)


@app.command("build")
def world_build(
    out: Path = typer.Option(..., "--out", help="directory to write the world into"),
    # the defaults are the demo's world (demo/config.py), the one the committed policy was made for
    seed: int = typer.Option(0, min=0, help="same seed and sizes, same bytes"),
    entities: int = typer.Option(
        2000,
        help="number of entities in the knowledge graph (at least 100; the default splits need about 350)",
    ),
    questions: int | None = typer.Option(
        None, min=1, help="size of the question pool (default: what the splits need + 30%)"
    ),
    rl: int = typer.Option(575, min=0, help="questions in the RL split"),
    validation: int = typer.Option(200, min=0, help="questions in the validation split"),
    sft: int = typer.Option(6000, min=0, help="questions in the SFT split"),
    parquet: bool = typer.Option(False, help="also write Parquet files (needs pyarrow)"),
) -> None:
    """Generate a world: graph, documents, multi-hop questions.

    One document per entity, and questions with unique answers split into RL, validation and
    SFT questions that share no answer. A world too small for the splits asked for is refused
    with the size that holds them (searched: a few seconds), or with fewer questions.
    """
    from worldgen.build import build_world
    from worldgen.graph import MIN_ENTITIES
    from worldgen.splits import TooFewQuestions

    if entities < MIN_ENTITIES:
        raise typer.BadParameter(f"a world needs at least {MIN_ENTITIES} entities", param_hint="--entities")
    sizes = dict(seed=seed, n_rl=rl, n_val=validation, n_sft=sft, questions=questions)
    try:
        result = build_world(out, entities=entities, parquet=parquet, **sizes)
    except TooFewQuestions as exc:
        raise UserError(_too_small(exc, entities, **sizes)) from None
    sizes = ", ".join(f"{k} {len(v)}" for k, v in result.splits.items())
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())
    typer.echo(f"wrote {out}: {len(result.graph.entities)} entities, questions: {sizes} ({timing})")


def _too_small(exc, entities: int, **sizes) -> str:
    """Why a world cannot fill its splits, and the smallest world that can."""
    from worldgen.build import smallest_world

    wanted = sizes["n_rl"] + sizes["n_val"] + sizes["n_sft"]
    asked = (
        f"{sizes['n_rl']} RL + {sizes['n_val']} validation + {sizes['n_sft']} SFT questions "
        f"(the pool holds {exc.training} for training and {exc.validation} for validation)"
    )
    fewer = "ask for fewer with --rl, --validation and --sft"
    if sizes["questions"] is not None and sizes["questions"] < wanted:
        return f"a pool of {sizes['questions']} questions (--questions) cannot fill {asked}: {fewer}"
    most = 16 * entities
    smallest = smallest_world(**sizes, above=entities, most=most)
    seed = sizes["seed"]
    if smallest is None:
        return f"no world of up to {most} entities with seed {seed} fills {asked}: {fewer}"
    return (
        f"a world of {entities} entities with seed {seed} cannot fill {asked}: build one of "
        f"{smallest} entities (with this seed the smallest that does, within 10), or {fewer}"
    )


@app.command("demo-questions")
def world_demo_questions(
    world: Path = typer.Option(
        ..., "--world", help="a directory written by `pbsd world build`", callback=world_dir
    ),
    out: Path = typer.Option(..., "--out", help="folder to write rl.jsonl and eval.jsonl into"),
    config: Path | None = typer.Option(
        None,
        help="a YAML or JSON file of demo settings (see demo/config.py); default: the demo's",
        exists=True,
        dir_okay=False,
    ),
) -> None:
    """Write the question files `pbsd demo` trains on.

    The RL questions of its difficulties (demo/questions.py), less the held-out ones in
    eval.jsonl. The Compose run (deploy/runs/demo-cpu.yaml) uses them, so that it measures what
    the demo measures.
    """
    from demo.questions import question_files

    files = question_files(demo_settings(config), world, out)
    typer.echo(
        f"wrote {files.train} ({files.train_questions} questions) and {files.evaluation} "
        f"({files.evaluation_questions})"
    )


@app.command("fingerprint")
def world_fingerprint_cmd(
    world: Path = typer.Option(
        ..., "--world", help="a directory written by `pbsd world build`", callback=world_dir
    ),
    stamp: Path | None = typer.Option(
        None,
        help="a checkpoint supervised on this world: record the fingerprint in its pbsd.json",
        callback=checkpoint_dir,
    ),
) -> None:
    """Print the world's fingerprint.

    The SHA-256 over its files' hashes; `pbsd demo` reuses a warm policy only when its pbsd.json
    names the fingerprint of the world the demo builds.
    """
    import json

    from worldgen.build import world_fingerprint

    fingerprint = world_fingerprint(json.loads((world / "manifest.json").read_text()))
    if stamp is not None:
        from services.model.checkpoint import stamp_world

        stamp_world(stamp, fingerprint)
    typer.echo(fingerprint)


@app.command("sft-data")
def world_sft_data(
    world: Path = typer.Option(
        ..., "--world", help="a directory written by `pbsd world build`", callback=world_dir
    ),
    out: Path = typer.Option(
        ..., "--out", help="JSONL file of chat trajectories to write", callback=output_file
    ),
    split: str = typer.Option("sft", help="which question split to solve"),
    limit: int | None = typer.Option(None, min=1, help="solve only the first N questions"),
    seed: int = typer.Option(0, min=0),
    detour_rate: float = typer.Option(
        0.25, callback=share, help="chance of a detour (vague search, wrong page, re-check) at each step"
    ),
    search_num: int = typer.Option(5, min=1, help="results the oracle asks of each search"),
    rename: float = typer.Option(
        0.0,
        callback=share,
        help="fraction of trajectories whose invented names are renamed consistently "
        "(fresh per trajectory), so they can only be fitted by copying (worldgen/rename.py)",
    ),
    final: str = typer.Option(
        "restate",
        help="how the last message writes the answer: restate ('So the R of X is A. The answer is A.' "
        "then \\boxed{A}) or boxed ('So the R of X is \\boxed{A}.': the box is its first mention)",
    ),
) -> None:
    """Write oracle trajectories for the SFT warm start.

    The oracle is a scripted expert using the offline tools; a question whose evidence the tools
    do not surface is skipped, never faked, and the skips are counted per reason.
    """
    from worldgen.oracle import FINAL_STYLES, write_sft_data

    if final not in FINAL_STYLES:
        raise typer.BadParameter(f"{final!r} is not one of {', '.join(FINAL_STYLES)}", param_hint="--final")
    if not (world / "questions" / f"{split}.jsonl").is_file():
        splits = ", ".join(sorted(p.stem for p in (world / "questions").glob("*.jsonl")))
        raise typer.BadParameter(f"{world} has no split {split!r} (it has: {splits})", param_hint="--split")
    stats = write_sft_data(
        world,
        out,
        split=split,
        limit=limit,
        seed=seed,
        detour_rate=detour_rate,
        search_num=search_num,
        rename=rename,
        final=final,
    )
    typer.echo(
        f"wrote {stats['written']} trajectories to {out} ({stats['tool_calls']} tool calls, "
        f"{stats['detours']} detours, {stats['renamed']} renamed)"
    )
    if stats["skipped"]:
        reasons = "; ".join(f"{n} {why}" for why, n in stats["skipped_because"].items())
        typer.echo(
            f"skipped {stats['skipped']} of {stats['questions']} questions, whose evidence the "
            f"tools did not surface (never faked): {reasons}"
        )
