"""``pbsd teacher tally``'s work: saved groups' turns sorted again from their stored evidence
(``services.scorer.sanity.retally``), summed in one pass, and said with their targets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import typer

from agent.chat import ChatTokenizer
from pbsd.cli.errors import UserError
from pbsd.cli.inputs import scored_with, write_output
from pbsd.sanity import checks
from proto.messages import ScoredGroup
from proto.sanity import TeacherSanity
from services.scorer.sanity import retally
from services.trainer.saved_groups import UnreadableGroups, iter_groups

__all__ = ["tally"]


def tally(
    model: Path, groups: list[Path], compare: Path | None, variant: str | None, out: Path | None
) -> None:
    """Sum the groups of ``groups`` and of ``variant``'s runs in ``compare``; print the figures, and
    write them to ``out``."""
    if (compare is None) != (variant is None):
        raise UserError("--compare and --variant go together", code=2)
    if not groups and compare is None:
        raise UserError("nothing to tally: give --groups, or --compare with --variant", code=2)
    if compare is not None and not (compare / "results").is_dir():
        raise UserError(f"{compare} is not a `pbsd compare` folder (no results/ in it)", code=2)
    if compare is not None:
        from demo.compare import trained_runs

        folders, seeds = trained_runs(compare, variant)
        if not seeds:
            raise UserError(f"{compare}/results holds no run of {variant}", code=2)
        if bare := [f.name for f in folders if not any((f / "groups").glob("step-*.msgpack"))]:
            raise UserError(
                f"{len(bare)} trained runs of {variant} kept no scored groups: {', '.join(bare)}", code=2
            )
        typer.echo(f"{variant}: {len(folders)} trained runs of {seeds} seeds in {compare}")
        groups = [*groups, *folders]
    # one pass, a step file at a time: a long run's groups never sit in memory together
    tok, count, specs, stored, sorted_anew = None, 0, set(), TeacherSanity(), TeacherSanity()
    for folder in groups:
        checked = False
        for _, g in _groups_of(folder):
            if g.scored:
                tok = tok or ChatTokenizer.from_pretrained(model)  # once there is something to sort
                if not checked:  # a folder is one run's, written with one tokenizer
                    scored_with(tok, g.group, model, folder)
                    checked = True
                count += 1
                specs.add((g.group.algorithm.eps_pos, g.group.algorithm.eps_neg))
                if len(specs) > 1:  # said before the sorting of what is left, which a long run makes slow
                    raise UserError(f"the groups use {len(specs)} deadbands; tally them apart", code=2)
                stored += g.diagnostics.sanity
                sorted_anew += retally(g, tok)
    if not count:
        where = ", ".join(str(g / "groups") for g in groups) or f"{variant}'s runs in {compare}"
        raise UserError(f"no scored PBSD groups in {where}", code=2)
    (eps_pos, eps_neg), figures = specs.pop(), sorted_anew.figures()
    figures.pop("correct_final_room_frac", None)
    shown = ("answer_free_turns", "answer_free_mean_s", "wrong_final_turns", "wrong_final_disfavoured_frac")
    report = {
        "groups": count,
        "figures": figures,
        "checks": checks(figures, eps_pos=eps_pos, eps_neg=eps_neg),
        "as_stored": {k: v for k, v in stored.figures().items() if k in shown},
    }
    if out is not None:
        write_output(out, json.dumps(report, indent=2))
    f, old = report["figures"], report["as_stored"]
    typer.echo(f"{count} scored groups, deadband [-{eps_neg:g}, {eps_pos:g}]")
    for mark in report["checks"]:
        value = "-" if mark["value"] is None else f"{mark['value']:+.4f}"
        met = {True: "met", False: "missed", None: "no turns"}[mark["met"]]
        typer.echo(f"  {mark['figure']}: {value} (target {mark['target']}: {met})")
    typer.echo(
        f"  turns: answer-free {int(f.get('answer_free_turns', 0))}, correct finals "
        f"{int(f.get('correct_final_turns', 0))}, wrong finals {int(f.get('wrong_final_turns', 0))}, "
        f"finals that box nothing {int(f.get('unboxed_final_turns', 0))}"
        + (
            f" ({f['unboxed_final_disfavoured_frac']:.0%} with s < -eps-)"
            if "unboxed_final_disfavoured_frac" in f
            else ""
        )
    )
    typer.echo(
        "  as stored: "
        + ", ".join(
            f"{k} {v:+.4f}" if k.endswith(("_s", "_frac")) else f"{k} {int(v)}" for k, v in old.items()
        )
    )


def _groups_of(folder: Path) -> Iterator[tuple[int, ScoredGroup]]:
    try:
        yield from iter_groups(folder)
    except UnreadableGroups as exc:
        raise UserError(str(exc)) from None
