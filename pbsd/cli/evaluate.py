"""``pbsd eval``: a policy's accuracy on a question file, as mean@k and pass@k."""

from __future__ import annotations

from pathlib import Path

import typer


def eval_cmd(
    model: Path = typer.Option(..., help="policy checkpoint (HF directory with its tokenizer)"),
    questions: Path = typer.Option(
        ..., help="question file (world format, {question, answer} or BrowseComp's)"
    ),
    out: Path = typer.Option(Path("eval.json"), help="JSON report to write"),
    samples: int = typer.Option(4, help="samples per question (the paper reports mean@4)"),
    corpus: Path | None = typer.Option(None, help="offline corpus: run the tool gateway in process over it"),
    tools_url: str | None = typer.Option(None, help="a running tool gateway instead of --corpus"),
    sglang_url: list[str] = typer.Option([], help="SGLang servers; the in-process engine when none"),
    limit: int | None = typer.Option(None, help="evaluate only the first N questions"),
    max_turns: int = typer.Option(300),
    max_tokens_per_turn: int = typer.Option(16_384),
    max_context: int = typer.Option(65_536),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(0.95, help="the paper evaluates with top-p 0.95"),
    concurrency: int = typer.Option(4, help="trajectories in flight"),
    date: str | None = typer.Option(None, help="'today' in the system prompt"),
    seed: int | None = typer.Option(None),
    compare_to: Path | None = typer.Option(
        None,
        help="an earlier report of this command on the same questions (say, of the policy before "
        "training, with the same --seed): the report adds the change from it, per question paired",
    ),
) -> None:
    """Evaluate a policy: accuracy as mean@k and pass@k, per difficulty, with a JSON report (with
    PBSD_JUDGE_BASE_URL set, also as graded by that LLM judge)."""
    import asyncio
    import json

    from pbsd.accuracy import compare, describe_change
    from services.rollout.agent import AgentLimits
    from services.rollout.runner import eval_main

    if (corpus is None) == (tools_url is None):
        raise typer.BadParameter("give exactly one of --corpus and --tools-url")
    before = json.loads(compare_to.read_text()) if compare_to is not None else None
    limits = AgentLimits(
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_context=max_context,
        temperature=temperature,
        top_p=top_p,
    )
    report = asyncio.run(
        eval_main(
            model,
            questions,
            samples=samples,
            corpus=corpus,
            tools_url=tools_url,
            sglang_urls=list(sglang_url),
            limit=limit,
            limits=limits,
            concurrency=concurrency,
            date=date,
            seed=seed,
        )
    )
    mismatch = None
    if before is not None:
        try:
            report["change"] = compare(before, report)
        except ValueError as exc:
            mismatch = exc  # refused once the report is written: the evaluation is not lost
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if mismatch is not None:
        raise typer.BadParameter(f"{compare_to}: {mismatch} (report in {out})", param_hint="--compare-to")
    from agent.grounding import describe

    overall = report["accuracy"]["all"]
    typer.echo(
        f"mean@{samples} {overall[f'mean@{samples}']:.3f}, pass@{samples} {overall['pass@k'][str(samples)]:.3f} "
        f"over {report['questions']} questions; {describe(report['grounding'])}; report in {out}"
    )
    if "judged_accuracy" in report:
        typer.echo(
            f"judged (PBSD_JUDGE_MODEL): mean@{samples} {report['judged_accuracy']['all'][f'mean@{samples}']:.3f}"
        )
    if "change" in report:
        typer.echo(f"change from {compare_to}: {describe_change(report['change'])}")
