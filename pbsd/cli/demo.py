"""``pbsd demo``: the main job, end to end on this machine."""

from __future__ import annotations

from pathlib import Path

import typer

from pbsd.cli.inputs import checkpoint_dir, demo_settings, positive


def demo_cmd(
    out: Path | None = typer.Option(None, help="output folder (default: runs/demo-<time>)"),
    algorithm: str | None = typer.Option(
        None, help="pbsd (default), grpo, or both (the same pipeline, compared)"
    ),
    steps: int | None = typer.Option(None, min=1, help="training steps"),
    prompts_per_step: int | None = typer.Option(None, min=1),
    group_size: int | None = typer.Option(None, min=1),
    eval_questions: int | None = typer.Option(
        None, min=1, help="held-out questions evaluated before and after"
    ),
    max_turns: int | None = typer.Option(None, min=1),
    max_tokens_per_turn: int | None = typer.Option(None, min=1),
    from_scratch: bool = typer.Option(
        False, help="rebuild the warm policy (oracle data, tokenizer, SFT) instead of using the committed one"
    ),
    config: Path | None = typer.Option(
        None, help="a YAML or JSON file of demo settings (see demo/config.py)", exists=True, dir_okay=False
    ),
    policy: Path | None = typer.Option(
        None, help="start from this checkpoint instead of the warm policy", callback=checkpoint_dir
    ),
    stall_timeout: float | None = typer.Option(
        None,
        callback=positive,
        help="stop a run that makes no training step for this many seconds (default 600)",
    ),
) -> None:
    """Train a tiny search agent end to end, with a report.

    Everything runs on this machine: the world, the warm policy, the services and the training
    run; the report compares held-out accuracy before and after.
    """
    import time

    settings = demo_settings(
        config,
        algorithm=algorithm,
        steps=steps,
        prompts_per_step=prompts_per_step,
        group_size=group_size,
        eval_questions=eval_questions,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        stall_timeout_s=stall_timeout,
        from_scratch=True if from_scratch else None,  # the flag's default leaves the file's value
        policy=str(policy) if policy is not None else None,
    )
    out = out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    from agent.grounding import describe  # after the settings: a wrong one is said at once
    from demo.run import run_demo
    from pbsd.accuracy import describe_change

    result = run_demo(settings, out)
    k = settings.eval_samples
    typer.echo("\n" + "=" * 72)
    typer.echo(f"pbsd demo finished in {result['seconds'] / 60:.1f} min: {out}")
    for name, report in result["evals"].items():
        acc = report["accuracy"]["all"]
        typer.echo(
            f"  {name:14} mean@{k} {acc[f'mean@{k}']:.3f}   turns {report['mean_turns']:.1f}   "
            f"tool calls {report['tool_calls']} ({report['tool_errors']} failed)   "
            f"finish {report['finish_reasons']}\n  {'':14} {describe(report['grounding'])}"
        )
        if "change" in report:
            typer.echo(f"  {'':14} change {describe_change(report['change'])}")
    for algo, run in result["runs"].items():
        m = run["record"]["latest_metrics"]
        extra = (
            f", teacher>student {m['teacher_higher_frac']:.2f}, filtered {m['filtered_frac']:.2f}"
            if "teacher_higher_frac" in m
            else ""
        )
        typer.echo(
            f"  {algo.upper()} run {run['id']}: {int(m.get('step', 0))} steps, last batch accuracy "
            f"{m.get('accuracy', 0):.2f}{extra}"
        )
    typer.echo(f"  report: {result['report']}")
    typer.echo("=" * 72)
