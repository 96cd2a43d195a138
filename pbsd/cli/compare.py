"""``pbsd compare``: K seeds x variants from one warm policy, compared on held-out questions."""

from __future__ import annotations

from pathlib import Path

import typer

from demo.variants import VARIANTS
from pbsd.accuracy import signed
from pbsd.cli.errors import UserError, problems
from pbsd.cli.inputs import checkpoint_dir, demo_settings, positive

# the comparison's own defaults where neither --config nor an option sets them
EVAL_QUESTIONS = 200
EVAL_SAMPLES = 2


def seed_list(text: str) -> list[int]:
    """``K`` (seeds 0..K-1) or a comma-separated list (``3,4``; a single seed: ``5,``)."""
    try:
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        k = int(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r}: a number of seeds K, or seeds separated by commas") from None
    if k < 1:  # "--seeds 0" reads as seed 0 to many; say how to write that
        raise typer.BadParameter(f"{text!r} is {k} seeds; at least 1 (seed 0 alone: '0,')")
    return list(range(k))


def compare_cmd(
    out: Path = typer.Option(..., help="output folder; the same folder again resumes the comparison"),
    variants: str = typer.Option(
        # the committed policy's teacher is taught to read the answer-first note, the demo's
        "grpo,pbsd-answer-first",
        help=f"comma-separated, of: {', '.join(VARIANTS)} (demo/variants.py, docs/compare.md)",
    ),
    seeds: str = typer.Option("3", help="K (seeds 0..K-1) or a comma-separated list of seeds"),
    baseline: str = typer.Option("grpo", help="the variant every other is compared against"),
    config: Path | None = typer.Option(
        None, help="a YAML or JSON file of demo settings (see demo/config.py)", exists=True, dir_okay=False
    ),
    policy: Path | None = typer.Option(
        None, help="start every run from this checkpoint instead of the warm policy", callback=checkpoint_dir
    ),
    steps: int | None = typer.Option(None, min=1, help="training steps of each run"),
    prompts_per_step: int | None = typer.Option(None, min=1),
    group_size: int | None = typer.Option(None, min=1),
    max_turns: int | None = typer.Option(None, min=1),
    max_tokens_per_turn: int | None = typer.Option(None, min=1),
    eval_questions: int | None = typer.Option(
        None, min=1, help=f"held-out questions from the world's reserve (default {EVAL_QUESTIONS})"
    ),
    eval_samples: int | None = typer.Option(
        None, min=1, help=f"samples per question: k of mean@k (default {EVAL_SAMPLES})"
    ),
    resamples: int = typer.Option(10_000, min=1, help="bootstrap resamples"),
    bootstrap_seed: int = typer.Option(0, min=0),
    stall_timeout: float | None = typer.Option(
        None,
        callback=positive,
        help="stop a run that makes no training step for this many seconds (default 600)",
    ),
    report_only: bool = typer.Option(
        False, help="train and evaluate nothing: write the summary and report of what has finished"
    ),
) -> None:
    """Train seeds x variants from one warm policy and compare them.

    Every run goes through the real pipeline (Redis and the four services, started once, runs
    submitted one after another through the trainer's API); every final policy and the warm
    policy are evaluated on the same held-out questions with the same sampling seeds. The report
    gives mean@k per variant and each difference from the baseline with two-level
    (runs x questions) paired-bootstrap 95% intervals, learning curves and the teacher sanity
    figures. See docs/compare.md.
    """
    from pydantic import ValidationError

    from demo.compare import CompareConfig

    settings = demo_settings(
        config,
        defaults={"eval_questions": EVAL_QUESTIONS, "eval_samples": EVAL_SAMPLES},
        steps=steps,
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        eval_questions=eval_questions,
        eval_samples=eval_samples,
        stall_timeout_s=stall_timeout,
        policy=str(policy.absolute()) if policy is not None else None,
    )
    try:
        compare = CompareConfig(
            demo=settings,
            variants=[v.strip() for v in variants.split(",") if v.strip()],
            seeds=seed_list(seeds),
            baseline=baseline,
            resamples=resamples,
            bootstrap_seed=bootstrap_seed,
        )
    except ValidationError as exc:
        raise UserError(problems(exc)) from None

    from demo.compare import run_compare

    try:
        summary = run_compare(compare, out, report_only=report_only)
    except SystemExit as exc:  # the demo's code stops with a sentence for the user
        if isinstance(exc.code, str):
            raise UserError(exc.code) from None
        raise
    typer.echo(describe(summary))


def describe(summary: dict) -> str:
    """The comparison's table for people: each variant's mean@k and its difference from the baseline."""
    k = summary["eval_samples"]
    stats = summary["statistics"]
    lines = ["=" * 72]
    if stats is None:
        lines.append("no run has finished yet")
    else:
        if "before" in stats:
            b = stats["before"]
            lines.append(
                f"  {'warm policy':18} mean@{k} {b['mean']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]"
            )
        for name, f in stats["variants"].items():
            line = f"  {name:18} mean@{k} {f['mean']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}] over {f['runs']} runs"
            if "difference" in f:
                d = f["difference"]
                line += f"; minus {d['against']} {signed(d['mean'])} [{signed(d['ci95'][0])}, {signed(d['ci95'][1])}]"
                if "over_seeds" in d:  # the t interval over the per-seed differences
                    low, high = d["over_seeds"]["ci95"]
                    line += f", over seeds [{signed(low)}, {signed(high)}]"
                if not d.get("paired_by_seed", True):
                    line += " (paired by question only: other seeds)"
            lines.append(line)
    if summary["pending"]:
        lines.append(f"  pending: {', '.join(summary['pending'])} (run the same command again)")
    lines += [f"  report: {summary['report']}", "=" * 72]
    return "\n".join(lines)
